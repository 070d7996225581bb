import jax
import pytest

from dcp_jax import AXES, make_mesh
from dcp_jax.mesh import ensure_cpu_devices


@pytest.mark.parametrize("tp,dcp", [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1), (1, 3)])
def test_make_mesh_shape(tp, dcp):
    mesh = make_mesh(tp, dcp)
    assert mesh.axis_names == AXES == ("tp", "dcp")
    assert dict(mesh.shape) == {"tp": tp, "dcp": dcp}
    assert len(set(mesh.devices.flat)) == tp * dcp


def test_make_mesh_explicit_devices():
    devs = jax.devices()[::-1][:4]
    mesh = make_mesh(2, 2, devices=devs)
    assert list(mesh.devices.flat) == devs


@pytest.mark.parametrize(
    "tp,dcp,match",
    [(0, 1, "tp must be"), (1, -2, "dcp must be"), (True, 1, "tp must be"), (1, 2.0, "dcp must be"),
     (4, 4, "needs 16 devices")],
)
def test_make_mesh_errors(tp, dcp, match):
    with pytest.raises(ValueError, match=match):
        make_mesh(tp, dcp)


def test_too_few_given_devices():
    with pytest.raises(ValueError, match="needs 4 devices, only 2 given"):
        make_mesh(2, 2, devices=jax.devices()[:2])


def test_ensure_cpu_devices_after_start():
    ensure_cpu_devices(8)  # already there
    with pytest.raises(ValueError, match=r"only 8 cpu device\(s\) exist: use a mesh of at most 8 devices, "
                                         r"or simulate 9 CPU devices \(JAX_PLATFORMS=cpu"):
        ensure_cpu_devices(9)


class _FakeDevice:
    def __init__(self, platform):
        self.platform = platform


@pytest.mark.parametrize("platform,count,shape", [("gpu", 1, (1, 1)), ("gpu", 4, (2, 2)), ("gpu", 8, (2, 4)),
                                                  ("gpu", 3, (1, 3)), ("cpu", 8, (2, 4))])
def test_default_mesh_fits_the_machine(platform, count, shape):
    # The default run on a machine with fewer accelerators than the documented tp=2 x dcp=4 picks a mesh
    # that fits and says which; on CPU it is the documented mesh, said nothing about.
    from dcp_jax.mesh import local_mesh_note, local_mesh_shape

    assert local_mesh_shape(2, devices=[_FakeDevice(platform)] * count) == shape
    note = local_mesh_note(*shape, platform)
    if platform == "cpu":
        assert note is None
    else:
        assert note.startswith(f"note: no mesh given: tp={shape[0]} x dcp={shape[1]} over this machine's "
                               f"{count} gpu device(s)") and "JAX_PLATFORMS=cpu" in note and "--mesh" in note
