"""bench/placement.py's settings: what it refuses before any rank starts."""
import sys

import pytest

from bench import placement


def test_one_step_is_refused_the_warm_up_would_be_the_measured_step(monkeypatch, tmp_path, capsys):
    """With --steps 1 the median step time was the first step's, warm-up included, set beside a prediction of a
    steady step."""
    monkeypatch.setattr(sys, "argv", ["placement.py", "--steps", "1", "--actor", str(tmp_path / "no_actor"),
                                      "--critic", str(tmp_path / "no_critic")])
    with pytest.raises(SystemExit) as stopped:
        placement.main()
    assert stopped.value.code == 2
    assert "--steps must be at least 2" in capsys.readouterr().err
