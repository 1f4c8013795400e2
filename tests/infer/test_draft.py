"""The draft model's own pool: after any accept/reject sequence its K/V are those of the
tokens that stand (its batched proposals equal a fresh draft's for each request alone), and
releasing a request frees every page it took."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from infer_models import make_model

from astrai.infer import num_free_pages, pages_for
from astrai.infer.draft import (
    draft_propose,
    draft_propose_batch,
    draft_release,
    draft_rollback,
    init_draft,
)

# room for the longest requests the strategies make (10 prompt tokens + 6 rounds of at most 4
# accepted and 3 own tokens, + 4 proposed positions: 56 positions, 28 pages) three times over:
# a draft short of pages proposes nothing, which is not what these tests are about
PAGE_SIZE, NUM_PAGES = 2, 3 * 28
PARAMS, CFG = make_model("gqa", seed=1)

token = st.integers(0, CFG.vocab_size - 1)
# k, how many proposed tokens are accepted, how many standing tokens are then dropped (a stop
# string, a grammar, a preemption), the tokens that follow
rounds = st.lists(
    st.tuples(
        st.integers(1, 4),
        st.integers(0, 4),
        st.integers(0, 3),
        st.lists(token, min_size=1, max_size=3),
    ),
    max_size=6,
)


@settings(max_examples=25, deadline=None)
@given(
    prompts=st.lists(
        st.lists(token, min_size=1, max_size=10),
        min_size=1,
        max_size=3,
    ),
    plan=rounds,
)
def test_rolled_back_draft_proposes_what_a_fresh_one_does(prompts, plan):
    state = init_draft(PARAMS, CFG, NUM_PAGES, PAGE_SIZE)
    requests = {str(i): list(p) for i, p in enumerate(prompts)}
    with torch.no_grad():
        for k, accepted, cut, own in plan:
            # the requests propose as one batch; each against a fresh draft of its own
            rids = list(requests)
            state, proposals = draft_propose_batch(state, rids, list(requests.values()), k)
            for rid, proposal in zip(rids, proposals):
                tokens = requests[rid]
                fresh = init_draft(PARAMS, CFG, NUM_PAGES, PAGE_SIZE)
                _, expected = draft_propose(fresh, rid, tokens, k)
                assert proposal.tokens == expected.tokens
                assert proposal.probs is None  # greedy: one-hot q
                standing = [*tokens, *proposal.tokens[: min(accepted, k)]]
                keep = max(1, len(standing) - cut)
                state = draft_rollback(state, rid, keep)
                assert len(state.pages[rid]) == pages_for(state.computed[rid], PAGE_SIZE)
                tokens[:] = standing[:keep] + own
        for rid in requests:
            state = draft_release(state, rid)
    assert num_free_pages(state.pool) == NUM_PAGES
    assert not state.pages and not state.computed


def test_a_full_draft_pool_proposes_nothing():
    state = init_draft(PARAMS, CFG, 2, PAGE_SIZE)
    with torch.no_grad():
        state, proposal = draft_propose(state, "a", list(range(8)), 4)
    assert proposal.tokens == [] and num_free_pages(state.pool) == 2


def test_an_empty_request_is_refused():
    with pytest.raises(ValueError, match="tokens"):
        draft_propose(init_draft(PARAMS, CFG, 2, PAGE_SIZE), "a", [], 4)
