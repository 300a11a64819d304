"""One step's model inputs as plain int lists: what the model runner builds from a ``SchedulerOutput``, and what
rank 0 hands the other tensor-parallel ranks (packed into one int64 tensor, no pickling).

The lists are everything a rank needs to run the step's forward pass: flat tokens and positions, the KV slot of
each token, per decode its row, context length and block table, per prefill chunk its rows, context length and
block table, the rows whose logits are computed (to sample, and for prompt logprobs), and KV block swaps to do first.
A model whose layers form several KV groups (``model.arch.KVGroups``) has a slot and block tables per group: the
per-group lists are stored one group after the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedllm.outputs import SchedulerOutput

_FLAT = ("input_ids", "positions", "slots", "decode_rows", "decode_lens", "logit_rows", "prompt_rows",
         "decode_states", "prefill_states", "prefill_save_rows", "prefill_save_slots", "fresh_states")
_NESTED = ("decode_tables", "prefills", "prefill_tables", "swap_out", "swap_in", "state_copies", "state_swap_out",
           "state_swap_in")


class StepGroups(NamedTuple):
    """Rank 0's use of a step's rows, per scheduled request: ``sample``: (request, its first logit row, row
    count); ``pool``: (embedding request, its first row, row count); ``prompt``: (request, its first prompt row,
    row count)."""

    sample: list[tuple]
    pool: list[tuple]
    prompt: list[tuple]


@dataclass
class StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat KV cache slot of each token (per group)
    decode_rows: list[int] = field(default_factory=list)  # rows of one-token (decode) sequences
    decode_lens: list[int] = field(default_factory=list)  # their context lengths (this token included)
    logit_rows: list[int] = field(default_factory=list)  # rows whose logits are computed (sampled / verified)
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits give prompt logprobs
    decode_tables: list[list[int]] = field(default_factory=list)  # per group, per decode: its context's blocks
    prefills: list[list[int]] = field(default_factory=list)  # per prefill chunk: [start row, end row, context len]
    prefill_tables: list[list[int]] = field(default_factory=list)  # per group, per prefill chunk: the same
    swap_out: list[list[int]] = field(default_factory=list)  # [device block, host block], before the forward
    swap_in: list[list[int]] = field(default_factory=list)  # [host block, device block]
    # a hybrid model's recurrent states (``layers.gated_deltanet``): the slot of each decode row and of each
    # prefill chunk, per chunk the rows after which it saves a snapshot (0: none) and into which slot, the slots
    # to zero before the forward (sequences starting), and [snapshot slot, slot] copies done before that
    decode_states: list[int] = field(default_factory=list)
    prefill_states: list[int] = field(default_factory=list)
    prefill_save_rows: list[int] = field(default_factory=list)
    prefill_save_slots: list[int] = field(default_factory=list)
    fresh_states: list[int] = field(default_factory=list)
    state_copies: list[list[int]] = field(default_factory=list)
    state_swap_out: list[list[int]] = field(default_factory=list)  # [device slot, host slot], with the KV swaps
    state_swap_in: list[list[int]] = field(default_factory=list)  # [host slot, device slot]

    @classmethod
    def from_scheduler_output(cls, so: SchedulerOutput, block_size: int) -> tuple["StepInputs", StepGroups]:
        """The step's inputs, and what rank 0 does with the rows it computes (``StepGroups``)."""
        bs = block_size
        st = cls(swap_out=[list(p) for p in so.swap_out], swap_in=[list(p) for p in so.swap_in],
                 state_swap_out=[list(p) for p in so.state_swap_out], state_swap_in=[list(p) for p in so.state_swap_in])
        groups = StepGroups([], [], [])
        num_groups = len(so.scheduled[0].block_ids) if so.scheduled else 1
        slots = [[] for _ in range(num_groups)]
        dtables = [[] for _ in range(num_groups)]
        ptables = [[] for _ in range(num_groups)]
        for s in so.scheduled:
            start = len(st.input_ids)
            n = len(s.token_ids)
            nc = s.num_computed_tokens
            st.input_ids.extend(s.token_ids)
            st.positions.extend(range(nc, nc + n))
            for g, table in enumerate(s.block_ids):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(nc, nc + n))
                if n == 1:
                    dtables[g].append(table[: (nc + bs) // bs])
                else:
                    ptables[g].append(table[: -(-(nc + n) // bs)])
            if n == 1:
                st.decode_rows.append(start)
                st.decode_lens.append(nc + 1)
            else:
                st.prefills.append([start, start + n, nc + n])
            if s.state_slot >= 0:
                if n == 1:
                    st.decode_states.append(s.state_slot)
                else:
                    st.prefill_states.append(s.state_slot)
                    st.prefill_save_rows.append(s.state_save_rows)
                    st.prefill_save_slots.append(s.state_save_slot)
                if s.state_restore >= 0:
                    st.state_copies.append([s.state_restore, s.state_slot])
                elif nc == 0:
                    st.fresh_states.append(s.state_slot)
            if s.pooling:
                groups.pool.append((s, start, n))
            elif s.sample:
                groups.sample.append((s, len(st.logit_rows), s.num_spec_tokens + 1))
                last_real = start + n - 1 - s.num_spec_tokens
                st.logit_rows.extend(range(last_real, start + n))
            if s.prompt_logprob_span is not None:
                lo, hi = s.prompt_logprob_span
                groups.prompt.append((s, len(st.prompt_rows), hi - lo))
                st.prompt_rows.extend(range(start + lo - nc, start + hi - nc))
        st.slots = [x for g in slots for x in g]
        st.decode_tables = [t for g in dtables for t in g]
        st.prefill_tables = [t for g in ptables for t in g]
        return st, groups

    @property
    def num_groups(self) -> int:
        """KV groups: one slot per token and group."""
        return len(self.slots) // len(self.input_ids) if self.input_ids else 1

    def group(self, g: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """Group ``g``'s slots, decode tables and prefill tables."""
        t, d, p = len(self.input_ids), len(self.decode_rows), len(self.prefills)
        return (self.slots[g * t:(g + 1) * t], self.decode_tables[g * d:(g + 1) * d],
                self.prefill_tables[g * p:(g + 1) * p])

    def pack(self) -> torch.Tensor:
        """One int64 tensor: [field lengths..., values...]; a nested field is its row lengths, then its values."""
        lengths: list[int] = []
        values: list[int] = []
        for name in _FLAT:
            v = getattr(self, name)
            lengths.append(len(v))
            values.extend(v)
        for name in _NESTED:
            rows = getattr(self, name)
            lengths.append(len(rows))
            values.extend(len(r) for r in rows)
            for r in rows:
                values.extend(r)
        return torch.tensor(lengths + values, dtype=torch.long)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "StepInputs":
        data = packed.tolist()
        n_fields = len(_FLAT) + len(_NESTED)
        lengths, pos = data[:n_fields], n_fields
        st = cls()
        for name, n in zip(_FLAT, lengths):
            setattr(st, name, data[pos : pos + n])
            pos += n
        for name, n in zip(_NESTED, lengths[len(_FLAT) :]):
            row_lens, pos = data[pos : pos + n], pos + n
            rows = []
            for m in row_lens:
                rows.append(data[pos : pos + m])
                pos += m
            setattr(st, name, rows)
        if pos != len(data):
            raise ValueError(f"malformed step inputs: {len(data) - pos} trailing values")
        return st
