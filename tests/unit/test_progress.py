"""Parsing training progress out of prefixed log lines."""

from clusterctl.progress import Progress


def test_progress_folds_step_done_and_failed_lines():
    p = Progress()
    assert p.feed("[10.0.0.1 trainer.0] step=3 loss=12.5000 trainer=0 pass=1 mode=sync")
    assert p.feed("[10.0.0.2 trainer.1] step=4 loss=9.2500 trainer=1 pass=1 mode=sync")
    assert not p.feed("[10.0.0.1 pserver.0] serving on 10.0.0.1:6170")
    assert not p.feed("[10.0.0.1 trainer.0] some other output")
    assert p.feed("[10.0.0.1 trainer.0] done steps=180 loss=6.2001 steps_per_s=412.5 wall_s=0.44 trainer=0 mode=sync")
    assert p.feed("[10.0.0.3 trainer.2] failed trainer=2 error=barrier-timeout")
    t0, t1, t2 = p.trainers[0], p.trainers[1], p.trainers[2]
    assert (t0.host, t0.step, t0.loss, t0.done, t0.steps_per_s, t0.wall_s) == ("10.0.0.1", 180, 6.2001, True, 412.5, 0.44)
    assert (t1.step, t1.loss, t1.done) == (4, 9.25, False)
    assert t2.failed == "barrier-timeout"
    assert p.other_lines == ["[10.0.0.1 pserver.0] serving on 10.0.0.1:6170", "[10.0.0.1 trainer.0] some other output"]
    assert p.table("x").row_count == 3
