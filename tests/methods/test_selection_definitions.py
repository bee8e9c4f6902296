"""The vectorised selection math against plain references written from METHODS.md.

References loop over heads, rows and tokens, sort with Python, and reuse nothing from
the module under test. Ties go to the earlier token, as the module documents.
"""

import math

import pytest
import torch

from sparseengine.methods import selection as sel

GQA = [(4, 4), (6, 2), (9, 3)]


def rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


# ------------------------------------------------------------------------- references


def ref_top(scores, candidates, count):
    return sorted(candidates, key=lambda j: (-float(scores[j]), j))[:count]


def ref_keep(scores, n, sink, budget, recent, tail):
    """METHODS.md keep rule for one head: sink + top-budget middle + last `tail`."""
    if n <= sink + budget + recent or sink + tail >= n:
        return list(range(n))
    middle = list(range(sink, n - tail))
    return sorted(set(range(sink)) | set(ref_top(scores, middle, budget)) | set(range(n - tail, n)))


def ref_snapkv_scores(q, k, kernel, pooling):
    w, hq, d = q.shape
    n, hkv, _ = k.shape
    g = hq // hkv
    m = n - w
    out = []
    for kh in range(hkv):
        s = [0.0] * m
        for h in range(kh * g, (kh + 1) * g):
            for i in range(w):
                pos = n - w + i
                logits = torch.stack([q[i, h].double() @ k[j, kh].double() for j in range(pos + 1)])
                probs = torch.softmax(logits / math.sqrt(d), dim=0)
                for j in range(m):
                    s[j] += float(probs[j]) / g
        pooled = []
        for j in range(m):
            inside = [s[j + o] for o in range(-(kernel // 2), kernel // 2 + 1) if 0 <= j + o < m]
            pooled.append(max(inside) if pooling == "max" else sum(inside) / kernel)
        out.append(pooled)
    return torch.tensor(out, dtype=torch.float64)


def ref_pyramid(L, B, beta, n, window):
    if L == 1 or n < 2 * B or n - window < B:
        return [B] * L
    lo = B / beta
    hi = 2 * B - lo
    if hi > n - window:
        hi = n - window
        lo = 2 * B - hi
    return [math.floor(hi - l * (hi - lo) / (L - 1) + 0.5) for l in range(L)]


def ref_h2o_accumulate(acc, probs):
    rows, hq, n = probs.shape
    hkv = acc.shape[0]
    g = hq // hkv
    out = torch.zeros(hkv, n, dtype=torch.float64)
    for kh in range(hkv):
        for j in range(n):
            total = float(acc[kh, j]) if j < acc.shape[1] else 0.0
            for h in range(kh * g, (kh + 1) * g):
                for i in range(rows):
                    total += float(probs[i, h, j]) / g
            out[kh, j] = total
    return out


def ref_quest_minmax(k, page_size):
    n, hkv, d = k.shape
    pages = (n + page_size - 1) // page_size
    kmax = torch.empty(pages, hkv, d)
    kmin = torch.empty(pages, hkv, d)
    for p in range(pages):
        for kh in range(hkv):
            for c in range(d):
                vals = [float(k[t, kh, c]) for t in range(p * page_size, min(n, (p + 1) * page_size))]
                kmax[p, kh, c], kmin[p, kh, c] = max(vals), min(vals)
    return kmax, kmin


def ref_quest_bounds(q, kmax, kmin):
    hq, d = q.shape
    pages, hkv, _ = kmax.shape
    g = hq // hkv
    out = torch.empty(hkv, pages, dtype=torch.float64)
    for kh in range(hkv):
        for p in range(pages):
            best = -math.inf
            for h in range(kh * g, (kh + 1) * g):
                u = sum(max(float(q[h, c] * kmax[p, kh, c]), float(q[h, c] * kmin[p, kh, c])) for c in range(d))
                best = max(best, u)
            out[kh, p] = best
    return out


def ref_quest_pages(bounds, n, ps, sink, recent, budget):
    pages = (n + ps - 1) // ps
    if n <= sink + budget + recent:
        return list(range(pages))
    forced = {t // ps for t in range(sink)} | {t // ps for t in range(n - recent, n)}
    others = [p for p in range(pages) if p not in forced]
    return sorted(forced | set(ref_top(bounds, others, max(3, budget // ps))))


def ref_omnikv_scores(q, k, mode):
    hq, d = q.shape
    n, hkv, _ = k.shape
    g = hq // hkv
    best = [-math.inf] * n
    for h in range(hq):
        logits = torch.tensor([float(q[h].double() @ k[j, h // g].double()) / math.sqrt(d) for j in range(n)])
        vals = torch.softmax(logits, 0) if mode == "probs" else logits
        best = [max(b, float(v)) for b, v in zip(best, vals)]
    return torch.tensor(best, dtype=torch.float64)


# -------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("n,sink,recent", [(10, 4, 4), (8, 4, 4), (100, 4, 16), (50, 0, 7), (30, 5, 0)])
def test_streaming_keep(n, sink, recent):
    got = sel.streaming_keep(n, sink, recent).tolist()
    want = list(range(n)) if n <= sink + recent else list(range(sink)) + list(range(n - recent, n))
    assert got == want


# ----------------------------------------------------------------------------- snapkv


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("n,w,kernel", [(40, 8, 7), (23, 5, 3), (12, 12, 5), (30, 1, 1)])
def test_snapkv_scores_match_reference(hq, hkv, pooling, n, w, kernel):
    seed = hq * 1000 + n * 10 + w
    q, k = rand(w, hq, 16, seed=seed), rand(n, hkv, 16, seed=seed + 1)
    got = sel.snapkv_scores(q, k, kernel, pooling)
    assert got.shape == (hkv, n - w)
    torch.testing.assert_close(got.double(), ref_snapkv_scores(q, k, kernel, pooling), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize(
    "n,w,sink,budget,recent",
    [(60, 8, 4, 10, 6), (60, 8, 4, 10, 12), (64, 4, 0, 20, 4), (40, 8, 4, 40, 6), (30, 8, 4, 3, 4), (20, 16, 4, 1, 2)],
)
def test_snapkv_keep_matches_reference(hq, hkv, pooling, n, w, sink, budget, recent):
    seed = hq + 7 * n + budget
    q, k = rand(w, hq, 8, seed=seed), rand(n, hkv, 8, seed=seed + 1)
    scores = sel.snapkv_scores(q, k, 7, pooling)  # max pooling makes ties: tie rule matters
    got = sel.snapkv_keep(scores, n, w, sink, budget, recent)
    assert torch.equal(got, got.sort(dim=-1).values)
    tail = max(recent, w)
    for kh in range(hkv):
        assert got[kh].tolist() == ref_keep(scores[kh], n, sink, budget, recent, tail)


def test_snapkv_budget_covering_prompt_is_exact():
    q, k = rand(8, 6, 8, seed=1), rand(50, 2, 8, seed=2)
    scores = sel.snapkv_scores(q, k)
    for budget in (50, 42, 1000):
        assert torch.equal(sel.snapkv_keep(scores, 50, 8, 4, budget, 4), torch.arange(50).expand(2, 50))


def test_snapkv_keep_count_is_uniform_across_heads():
    scores = rand(3, 90, seed=3)
    got = sel.snapkv_keep(scores, 100, 10, 4, 20, 16)
    assert got.shape == (3, 4 + 20 + 16)
    assert all(len(set(row.tolist())) == got.shape[1] for row in got)


def test_snapkv_pool_padding_rules():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    torch.testing.assert_close(sel.snapkv_pool(x, 3, "avg"), torch.tensor([[1.0, 2.0, 5.0 / 3.0]]))
    neg = torch.tensor([[-1.0, -2.0, -3.0]])
    assert sel.snapkv_pool(neg, 3, "max").tolist() == [[-1.0, -1.0, -2.0]]  # zero padding never wins


# -------------------------------------------------------------------------- pyramidkv


@pytest.mark.parametrize(
    "L,B,beta,n,window",
    [(32, 128, 20, 4096, 32), (4, 100, 20, 1000, 8), (28, 64, 5, 150, 32), (10, 300, 20, 620, 32),
     (7, 50, 3.5, 100, 10), (1, 40, 20, 999, 8), (5, 100, 20, 150, 8), (6, 100, 20, 220, 130)],
)
def test_pyramidkv_budgets(L, B, beta, n, window):
    got = sel.pyramidkv_budgets(L, B, beta, n, window)
    assert got == ref_pyramid(L, B, beta, n, window)
    assert len(got) == L
    assert abs(sum(got) / L - B) <= 0.5
    assert all(a >= b for a, b in zip(got, got[1:]))


def test_pyramidkv_known_values_and_clipping():
    assert sel.pyramidkv_budgets(4, 100, 20, 1000, 8) == [195, 132, 68, 5]
    # max = 195 > n - window = 180: clipped, min = 200 - 180 = 20
    assert sel.pyramidkv_budgets(4, 100, 20, 188, 8) == [100] * 4  # n < 2B: uniform
    assert sel.pyramidkv_budgets(3, 100, 20, 210, 30) == [180, 100, 20]
    assert sel.pyramidkv_budgets(3, 100, 20, 200, 100) == [100, 100, 100]  # n - window < B


# -------------------------------------------------------------------------------- h2o


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("n_old,n,rows", [(0, 12, 12), (12, 13, 1), (20, 25, 5)])
def test_h2o_accumulate_matches_reference(hq, hkv, n_old, n, rows):
    acc = rand(hkv, n_old, seed=n).abs()
    probs = torch.softmax(rand(rows, hq, n, seed=n + 1), dim=-1)
    got = sel.h2o_accumulate(acc, probs)
    torch.testing.assert_close(got.double(), ref_h2o_accumulate(acc, probs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hkv", [1, 2, 3])
@pytest.mark.parametrize("n,sink,budget,recent",
                         [(100, 4, 20, 16), (40, 0, 10, 5), (30, 4, 30, 4), (37, 4, 29, 4), (50, 3, 1, 0)])
def test_h2o_keep_matches_reference(hkv, n, sink, budget, recent):
    acc = rand(hkv, n, seed=n * hkv + budget)
    got = sel.h2o_keep(acc, sink, budget, recent)
    for kh in range(hkv):
        assert got[kh].tolist() == ref_keep(acc[kh], n, sink, budget, recent, recent)


def test_h2o_decode_loop_keeps_the_total():
    hkv, hq, sink, budget, recent = 2, 6, 2, 5, 3
    acc = torch.zeros(hkv, 0)
    n = 0
    for step in range(15):
        n += 1
        probs = torch.softmax(rand(1, hq, n, seed=step), dim=-1)
        acc = sel.h2o_accumulate(acc, probs)
        kept = sel.h2o_keep(acc, sink, budget, recent)
        acc = acc.gather(1, kept)
        n = kept.shape[1]
        assert n == min(step + 1, sink + budget + recent)


# ------------------------------------------------------------------------------ quest


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("n,ps", [(37, 8), (32, 8), (5, 16), (50, 1)])
def test_quest_minmax_and_bounds_match_reference(hq, hkv, n, ps):
    k, q = rand(n, hkv, 6, seed=n + hq), rand(hq, 6, seed=n + hq + 1)
    kmax, kmin = sel.quest_page_minmax(k, ps)
    rmax, rmin = ref_quest_minmax(k, ps)
    assert torch.equal(kmax, rmax) and torch.equal(kmin, rmin)
    bounds = sel.quest_page_bounds(q, kmax, kmin)
    torch.testing.assert_close(bounds.double(), ref_quest_bounds(q, rmax, rmin), rtol=1e-5, atol=1e-5)
    g = hq // hkv
    for kh in range(hkv):  # an upper bound on every q . k in the page
        for h in range(kh * g, (kh + 1) * g):
            dots = k[:, kh] @ q[h]
            for t in range(n):
                assert dots[t] <= bounds[kh, t // ps] + 1e-5


@pytest.mark.parametrize("hkv", [1, 3])
@pytest.mark.parametrize(
    "n,ps,sink,recent,budget",
    [(200, 8, 4, 16, 40), (200, 16, 0, 0, 16), (203, 16, 20, 5, 64), (100, 4, 4, 4, 92), (90, 4, 4, 4, 60),
     (64, 8, 8, 8, 1)],
)
def test_quest_select_matches_reference(hkv, n, ps, sink, recent, budget):
    pages = (n + ps - 1) // ps
    bounds = rand(hkv, pages, seed=n + ps + budget)
    got = sel.quest_select_pages(bounds, n, ps, sink, recent, budget)
    for kh in range(hkv):
        want = ref_quest_pages(bounds[kh], n, ps, sink, recent, budget)
        assert got[kh].tolist() == want
        if n > sink + budget + recent:
            forced = {t // ps for t in range(sink)} | {t // ps for t in range(n - recent, n)}
            assert forced <= set(want) and len(want) - len(forced) >= min(3, pages - len(forced))


def test_pages_to_tokens():
    tokens, valid = sel.pages_to_tokens(torch.tensor([[0, 2], [1, 2]]), 4, 10)
    assert tokens.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert valid.tolist() == [[True] * 6 + [False] * 2, [True] * 6 + [False] * 2]


@pytest.mark.parametrize("hq,hkv", GQA)
def test_quest_and_omnikv_find_the_needle(hq, hkv):
    n, d, ps, g = 400, 16, 16, hq // hkv
    for trial in range(3):
        k, q = rand(n, hkv, d, seed=trial), rand(hq, d, seed=trial + 50)
        needle, head = 150 + 37 * trial, trial % hq
        k[needle, head // g] = 30 * q[head] / q[head].norm()
        kmax, kmin = sel.quest_page_minmax(k, ps)
        pages = sel.quest_select_pages(sel.quest_page_bounds(q, kmax, kmin), n, ps, 4, 32, 64)
        assert needle // ps in pages[head // g].tolist()
        for mode in ("logits", "probs"):
            chosen = sel.omnikv_select(sel.omnikv_token_scores(q, k, mode), 4, 16, 32)
            assert needle in chosen.tolist()


# ----------------------------------------------------------------------------- omnikv


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("mode", ["logits", "probs"])
@pytest.mark.parametrize("n", [1, 17, 64])
def test_omnikv_scores_match_reference(hq, hkv, mode, n):
    q, k = rand(hq, 8, seed=n + hq), rand(n, hkv, 8, seed=n + hq + 1)
    got = sel.omnikv_token_scores(q, k, mode)
    torch.testing.assert_close(got.double(), ref_omnikv_scores(q, k, mode), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,sink,budget,recent", [(100, 4, 20, 16), (40, 0, 10, 5), (30, 4, 30, 4), (64, 8, 8, 0)])
def test_omnikv_select_matches_reference(n, sink, budget, recent):
    scores = rand(n, seed=n + budget)
    got = sel.omnikv_select(scores, sink, budget, recent)
    assert got.tolist() == ref_keep(scores, n, sink, budget, recent, recent)


# ------------------------------------------------------------------ budget >= n: exact


def test_budget_at_least_n_keeps_everything():
    n, hkv, hq = 45, 3, 9
    k, q = rand(n, hkv, 8, seed=9), rand(hq, 8, seed=10)
    everything = torch.arange(n).expand(hkv, n)
    assert torch.equal(sel.snapkv_keep(sel.snapkv_scores(q[None].expand(4, hq, 8), k), n, 4, 64, n, 512), everything)
    assert torch.equal(sel.h2o_keep(rand(hkv, n, seed=1), 64, n, 512), everything)
    assert torch.equal(sel.omnikv_select(sel.omnikv_token_scores(q, k), 64, n, 512), torch.arange(n))
    kmax, kmin = sel.quest_page_minmax(k, 16)
    pages = sel.quest_select_pages(sel.quest_page_bounds(q, kmax, kmin), n, 16, 64, 512, n)
    assert torch.equal(pages, torch.arange(3).expand(hkv, 3))
    tokens, valid = sel.pages_to_tokens(pages, 16, n)
    assert tokens[valid].view(hkv, n).equal(everything)
    assert torch.equal(sel.streaming_keep(n, 64, 512), torch.arange(n))
    assert all(b == n for b in sel.pyramidkv_budgets(4, n, 20, n, 4))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: sel.streaming_keep(10, -1, 4), "sink_tokens"),
        (lambda: sel.streaming_keep(10, 4, 2.5), "recent_tokens"),
        (lambda: sel.snapkv_scores(rand(4, 6, 8, seed=0), rand(10, 4, 8, seed=0)), "Hq=6"),
        (lambda: sel.snapkv_scores(rand(4, 4, 8, seed=0), rand(10, 4, 6, seed=0)), "head dims"),
        (lambda: sel.snapkv_scores(rand(12, 4, 8, seed=0), rand(10, 4, 8, seed=0)), "window w=12"),
        (lambda: sel.snapkv_scores(rand(4, 4, 8, seed=0), rand(10, 4, 8, seed=0), 4), "snapkv_kernel"),
        (lambda: sel.snapkv_scores(rand(4, 4, 8, seed=0), rand(10, 4, 8, seed=0), 7, "mean"), "snapkv_pooling"),
        (lambda: sel.snapkv_scores(rand(4, 8, seed=0), rand(10, 4, 8, seed=0)), r"q_window must be \[w, Hq, d\]"),
        (lambda: sel.snapkv_keep(rand(2, 10, seed=0), 20, 8, 4, 4, 4), r"n - window"),
        (lambda: sel.snapkv_keep(rand(2, 12, seed=0), 20, 8, 4, -3, 4), "budget"),
        (lambda: sel.pyramidkv_budgets(0, 100, 20, 1000, 8), "num_layers"),
        (lambda: sel.pyramidkv_budgets(4, 100, 0.5, 1000, 8), "pyramidkv_beta"),
        (lambda: sel.h2o_accumulate(rand(2, 10, seed=0), rand(1, 4, 8, seed=0)), "n_old=10"),
        (lambda: sel.h2o_keep(rand(10, seed=0), 4, 4, 4), "acc_scores"),
        (lambda: sel.quest_page_minmax(rand(10, 2, 4, seed=0), 0), "quest_page_size"),
        (lambda: sel.quest_select_pages(rand(2, 5, seed=0), 100, 16, 4, 4, 4), "P=5"),
        (lambda: sel.pages_to_tokens(rand(2, 3, seed=0), 16, 40), "pages"),
        (lambda: sel.omnikv_token_scores(rand(4, 8, seed=0), rand(10, 4, 8, seed=0), "max"), "omnikv_score"),
        (lambda: sel.omnikv_select(rand(10, seed=0), True, 4, 4), "sink_tokens"),
    ],
)
def test_bad_input_raises_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()
