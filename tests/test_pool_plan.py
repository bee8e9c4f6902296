"""The KV pool's tiers, sized by plan_pool: plain arithmetic, no model."""

from __future__ import annotations

from sparseengine.engine.pool_plan import plan_pool

MB = 1 << 20


def test_two_tiers_hold_more_whole_requests_within_the_budget():
    # DeltaKV's shape at 128K (pages of 16 tokens): 2 MiB a page in all 32 layers, 0.55 MiB
    # in the 5 full layers plus the codec's bytes; 8320 pages a request, 133 of them narrow
    budget, page_all, page_wide = 110_000 * MB, 2 * MB, int(0.55 * MB)
    plan = plan_pool(budget, page_all, page_wide, tuple(range(5, 32)), 8320, 133)
    one = budget // page_all
    assert plan.tiered and plan.one_tier_pages == one and one // 8320 == 6
    b = plan.requests - 1  # compressed requests beside one prompt held whole
    assert plan.narrow_pages >= 8320 + b * 133 and plan.num_pages - plan.narrow_pages == b * (8320 - 133)
    spent = plan.narrow_pages * page_all + (plan.num_pages - plan.narrow_pages) * page_wide
    assert budget - page_all < spent <= budget  # the leftover bytes went to narrow pages
    assert plan.requests == 1 + (budget - 8320 * page_all) // (133 * page_all + 8187 * page_wide) > 6


def test_one_tier_where_two_would_not_help():
    one = plan_pool(100 * MB, MB, MB // 2, (), 64, 8)
    assert not one.tiered and one.num_pages == one.narrow_pages == 100
    # every page narrow once compressed, or a wide page as large as a whole one
    assert not plan_pool(100 * MB, MB, MB // 2, (1, 2), 64, 64).tiered
    assert not plan_pool(100 * MB, MB, MB, (1, 2), 64, 8).tiered
    # room for one whole prompt only: no compressed request beside it
    small = plan_pool(80 * MB, MB, MB // 2, (1, 2), 64, 8)
    assert not small.tiered and small.num_pages == 80
    # 100 MB: one whole prompt (64 MB) and one compressed request (8 + 56 / 2 MB): two, where one tier holds one
    two = plan_pool(100 * MB, MB, MB // 2, (1, 2), 64, 8)
    assert two.tiered and two.requests == 2 and (two.narrow_pages, two.num_pages) == (72, 128)
