"""Where a cache's planes sit is decided once, by the stacking: one tier or two, and whether a scan crosses the link."""

from fathom_jax.index.plane_stacking import OneTier, TwoTiers, stacking


def test_the_stacking_follows_the_resident_and_warm_planes():
    assert stacking((0, 0)) == OneTier() and OneTier().crosses_link
    assert stacking((4, 4)) == OneTier(in_hbm=True) and not OneTier(in_hbm=True).crosses_link
    assert stacking((4, 4), warm=8) == OneTier(in_hbm=True)  # every plane resident: nothing left to keep warm
    for resident, warm in (((1, 0), 0), ((4, 3), 0), ((0, 0), 8), ((1, 1), 16)):
        stack = stacking(resident, warm)
        assert stack == TwoTiers(resident, warm) and stack.crosses_link, (resident, warm)
