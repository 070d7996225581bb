"""The scheduler's admission of requests prefilled elsewhere (prefill/decode disaggregation,
`dcp_jax.disagg`): a slot and the prompt's pages reserved while a prefill instance computes the KV,
then the request admitted straight into decoding. A part of `Scheduler` (its base class): it reads and
changes the scheduler's queues, so it never runs alone.
"""

from __future__ import annotations

from collections.abc import Callable

from dcp_jax.serving.request import Request, RequestState


class PrefilledAdmission:
    """`reserve_prefilled` and `admit_prefilled`, over the `Scheduler` state they share: `kv`, `layout`,
    `waiting`, `running`, `requests`, `reserved`, `refuse` and `append`."""

    def reserve_prefilled(self, request: Request) -> bool | None:
        """Hold a slot and the prompt's pages for `request` before a prefill instance computes its KV
        (which `admit_prefilled` then writes straight into them): what is on the way counts against the
        pool like what is running. True when reserved; None when no slot or pages are free now, or
        requests wait for recompute (FCFS: try again after a step); False when the request can never run
        (finished, as `add_request`). `fail` and `abort` give a reservation back."""
        if self.refuse(request):
            return False
        if (taken := self.take_prompt_pages(request)) is None:
            return None
        self.reserved[request.request_id] = taken
        return True

    def take_prompt_pages(self, request: Request) -> Request | None:
        kv, need = self.kv, self.layout.blocks_for(request.num_prompt_tokens)
        if self.waiting or not kv.free_slots or need > kv.num_available:
            return None
        kv.admit(request)
        kv.grow(request, need)
        return request

    def admit_prefilled(self, request: Request, first_token: int, first_logprob: float | None,
                        write: Callable[[list[int]], None], top=None) -> bool | None:
        """Admit `request` straight into decoding: its prompt's KV was computed elsewhere (a prefill
        instance) and its first token sampled there. Uses its reservation (`reserve_prefilled`) or takes
        a slot and the prompt's pages now, calls `write(pages)` to put the KV into them (block-table
        order), then records the first token (which may finish the request at once). Returns True when
        admitted; without a reservation None when no slot or pages are free now, or requests wait for
        recompute (try again after a step), False when the request can never run (finished with
        finish_reason "error", as `add_request` does); `top`: the first token's top logprobs (ids,
        logprobs). A duplicate id raises UserError."""
        if self.reserved.get(request.request_id) is request:
            del self.reserved[request.request_id]
        elif self.refuse(request):
            return False
        elif self.take_prompt_pages(request) is None:
            return None
        request.state, request.num_computed = RequestState.DECODING, request.num_prompt_tokens
        self.requests[request.request_id] = request
        self.running.append(request)
        write(list(request.pages))
        self.append(request, first_token, first_logprob, top=top)
        return True
