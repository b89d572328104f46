"""SFT says, once per plateau, that its loss has sat flat for FLAT_STEPS steps."""

from asyncrl.trainer.sft import FLAT_STEPS, PlateauWatch


def test_a_flat_loss_is_reported_once_and_again_after_a_new_low_and_another_plateau():
    watch = PlateauWatch(start_step=0)
    said = [(step, watch.add(step, 2.0)) for step in range(1, FLAT_STEPS + 5)]
    reports = [(step, text) for step, text in said if text]
    assert [step for step, _ in reports] == [FLAT_STEPS + 1]
    assert f"has not fallen for {FLAT_STEPS} steps (lowest 2 at step 1, now 2)" in reports[0][1]
    assert watch.add(FLAT_STEPS + 5, 1.0) is None  # a new low ends the plateau
    later = [watch.add(step, 1.0 - 1e-4) for step in range(FLAT_STEPS + 6, 2 * FLAT_STEPS + 10)]
    assert sum(text is not None for text in later) == 1  # 0.01% lower is not a new low: a second plateau


def test_a_falling_loss_is_never_reported():
    watch = PlateauWatch(start_step=0)
    assert all(watch.add(step, 10.0 * 0.98**step) is None for step in range(1, 3 * FLAT_STEPS))
