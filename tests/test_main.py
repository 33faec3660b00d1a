"""``python -m pallas_prefill`` (README's first command): its options, and a run that
checks both kernels against the reference."""

from __future__ import annotations

import pytest

from pallas_prefill import __main__ as main_module


def test_help_prints_the_options(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main_module.main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  assert "usage: python -m pallas_prefill" in text
  assert "--seed" in text and "--calls" in text


def test_bad_calls_is_an_error(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main_module.main(["--calls", "0"])
  assert exit_info.value.code == 2
  assert "--calls must be at least 1" in capsys.readouterr().err


def test_a_seeded_run_checks_both_kernels(capsys):
  assert main_module.main(["--seed", "7", "--calls", "1"]) == 0
  text = capsys.readouterr().out
  assert "seed 7" in text
  assert "mha_prefill" in text and "mla_prefill" in text and text.rstrip().endswith("OK")
