"""A temperature past float32's range is refused, not turned into inf (uniform sampling)."""

import pytest
from pydantic import ValidationError

from pyserve.sampling_params import FLOAT32_MAX, SamplingParams


def test_temperature_beyond_float32_is_refused():
    assert SamplingParams(temperature=FLOAT32_MAX).temperature == FLOAT32_MAX
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=1e308)
