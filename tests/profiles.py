"""The suite's Hypothesis profiles, and how many examples a property test runs under each.

- ``default`` (a developer's ``python -m pytest -q``): every property its own count, the first
  argument of `examples`; random draws.
- ``ci``, loaded where ``CI`` is set (.ci/run): the count given as ``ci=``, derandomized (the same
  examples every run: CI's time stays put, a red run reproduces on any machine), no example database.
  A property whose examples each compile kernels (Numba, NVRTC or the CUDA emulator's C++: 10 to 50 s
  a random spec on CI's 2 cores) runs a few there; the nightly run is where many are drawn. CI also
  skips the cases marked `nightly_case` ("nightly: ..." in its summary: kernel configs that are no
  default, sizes whose tiles and branches a kept case takes too) and the trims behind `in_ci()`.
- ``nightly``, loaded where ``SSMC_PROPERTY_EXAMPLES=N`` is set: N examples of every property,
  random draws (docs/performance.md, "Reliability").
- ``no-shrink``: a failing example reported as found, not shrunk (shrinking a slow GPU property's
  example can take longer than a device call; rerun it with its seed); counts as ``default``.

``pytest --hypothesis-profile=NAME`` picks a profile over the environment (tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

# the properties run whole pipelines: an example takes seconds, not Hypothesis' 200 ms
QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=QUIET)
settings.register_profile("nightly", deadline=None, suppress_health_check=QUIET,
                          max_examples=int(os.environ.get("SSMC_PROPERTY_EXAMPLES") or 10000))
settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])


def select_profile() -> str:
    """The profile the environment asks for: nightly where SSMC_PROPERTY_EXAMPLES is set, else ci where
    CI is, else Hypothesis' default. Loaded by conftest before any test module is imported."""
    if os.environ.get("SSMC_PROPERTY_EXAMPLES"):
        return "nightly"
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        return "ci"
    return "default"


def _profile() -> str:
    """The profile loaded now, by the name it was registered under (`--hypothesis-verbosity` loads
    "ci-with-verbose-verbosity" for "ci")."""
    return settings.get_current_profile_name().split("-with-")[0]


def examples(default: int, ci: int | None = None) -> int:
    """`max_examples` of a property test under the profile loaded now (read as its module is imported):
    `default` locally, `ci` (`default` where not given) in CI, SSMC_PROPERTY_EXAMPLES nightly."""
    profile = _profile()
    if profile == "nightly":
        return settings.default.max_examples
    if profile == "ci" and ci is not None:
        return ci
    return default


def nightly() -> bool:
    """Whether the nightly profile is loaded (its draws random where others' are fixed)."""
    return _profile() == "nightly"


def in_ci() -> bool:
    """Whether the ci profile is loaded (CI's 2 cores: a test may leave a case that repeats another's
    shape at a long compile to the local and nightly runs)."""
    return _profile() == "ci"


def nightly_case(*values, reason: str):
    """A `pytest.mark.parametrize` case that CI skips ("nightly: `reason`"), run locally and nightly: a
    non-default kernel config, or a size whose branches a case CI keeps takes too (CI's 30 minutes)."""
    return pytest.param(*values, marks=pytest.mark.skipif(in_ci(), reason=f"nightly: {reason}"))
