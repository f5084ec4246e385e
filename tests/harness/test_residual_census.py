"""The residual census (``harness/residual_census.py``) identifies tensors by ``id``: every tensor whose id it
records must stay alive until the count, or a later tensor reusing the id would be taken for it."""

from __future__ import annotations

import torch

from harness.residual_census import _Census

WIDTH = 16


def test_a_norm_input_narrower_than_the_stream_is_kept_while_its_id_is_recorded():
    """A q/k norm reads a tensor narrower than the stream. Recorded as a norm input but freed, its id could be
    reused by a later residual add's result, which would then count as read by a norm (LongCat-Flash's census
    counted 9 adds or 8, depending on what the process had allocated before)."""
    census = _Census(WIDTH)
    narrow, wide = torch.zeros(2, WIDTH // 2), torch.zeros(2, WIDTH)
    census.read_by_norm(narrow)
    census.read_by_norm(wide)
    census.made_by_norm(torch.ones(2, WIDTH))
    recorded = census.norm_inputs | census.norm_outputs | census.stream
    assert recorded <= {id(t) for t in census.kept}
    assert {id(narrow), id(wide)} <= census.norm_inputs
