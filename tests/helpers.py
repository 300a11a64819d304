"""Shared checks for tests."""


def assert_greedy_close(ours_ids, ours_top, ref_ids, ref_logprobs, name=""):
    """Token-for-token equality, except at a near-tie (as vLLM's check_logprobs_close): at the first position
    where the two differ, each side's token must be among the other's top-5; the sequences are not compared
    after that. Returns the number of leading tokens that matched exactly.

    ours_top: per position, a list of our top-5 token ids. ref_logprobs: per position, the reference's
    log-softmax row (a tensor).
    """
    n = min(len(ours_ids), len(ref_ids))
    for i in range(n):
        if ours_ids[i] == ref_ids[i]:
            continue
        ref_top5 = ref_logprobs[i].topk(5).indices.tolist()
        assert ours_ids[i] in ref_top5 and ref_ids[i] in ours_top[i], (
            f"{name}: token {i} differs and is no near-tie: ours {ours_ids[i]} (ref top5 {ref_top5}), "
            f"ref {ref_ids[i]} (our top5 {ours_top[i]})"
        )
        gap = abs(ref_logprobs[i][ours_ids[i]].item() - ref_logprobs[i][ref_ids[i]].item())
        assert gap < 0.1, f"{name}: token {i} differs with a logprob gap of {gap:.3f} in the reference"
        return i
    assert len(ours_ids) == len(ref_ids), f"{name}: lengths differ: ours {len(ours_ids)}, ref {len(ref_ids)}"
    return n
