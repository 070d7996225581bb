"""Per-device kernels. Kernels know nothing of meshes: they see one device's arrays."""
