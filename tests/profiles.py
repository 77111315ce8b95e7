"""`examples(n)`: a property's own example count, given for the ci profile, scaled to the loaded one.

The profiles are registered in tests/conftest.py; a test that needs more (a cheap pure function with
a wide input space) or fewer (each example a subprocess or a whole replay) than the profile's count
says `@examples(n)` with n its count under ci, so the dev profile shrinks it by the same factor.
"""

from __future__ import annotations

from hypothesis import settings


def examples(n: int) -> settings:
    """Settings of `n` examples under the ci profile, the same share of the loaded profile's count."""
    share = settings().max_examples / settings.get_profile("ci").max_examples  # settings(): the loaded profile
    return settings(max_examples=max(1, round(n * share)))
