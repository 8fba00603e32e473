import dataclasses
import math

import pytest

from streamrl.scheduling.latency import LatencyProfile

pytestmark = [pytest.mark.unit]


def _profile():
  return LatencyProfile(
      batch_sizes=(1, 4, 16), ptl_s=(0.010, 0.012, 0.030), prefill_s_per_token=1e-4
  )


def test_measured_points_are_exact():
  p = _profile()
  assert p.ptl(1) == pytest.approx(0.010)
  assert p.ptl(4) == pytest.approx(0.012)
  assert p.ptl(16) == pytest.approx(0.030)


def test_missing_batch_size_interpolates_linearly():
  p = _profile()
  assert p.ptl(2) == pytest.approx(0.010 + 0.002 / 3)
  assert p.ptl(10) == pytest.approx(0.012 + 0.018 * 6 / 12)


def test_beyond_ends_extrapolates_and_bs0_is_bs1():
  p = _profile()
  assert p.ptl(0) == p.ptl(1) == pytest.approx(0.010)
  assert p.ptl(-5) == pytest.approx(0.010)
  assert p.ptl(28) == pytest.approx(0.030 + 0.018 * 12 / 12)


def test_never_zero_or_negative():
  # A decreasing first segment would extrapolate below zero for huge sizes.
  p = LatencyProfile(batch_sizes=(8, 16), ptl_s=(0.02, 0.01))
  assert p.ptl(1000) > 0
  assert p.ptl(0) > 0
  single = LatencyProfile(batch_sizes=(4,), ptl_s=(0.5,))
  assert single.ptl(0) == single.ptl(1000) == 0.5


def test_json_roundtrip(tmp_path):
  p = _profile()
  path = tmp_path / "sub" / "profile.json"
  p.to_json(path)
  assert LatencyProfile.from_json(path) == p
  q = dataclasses.replace(p, ptl_rel_se=(0.01,) * len(p.batch_sizes))
  q.to_json(path)
  assert LatencyProfile.from_json(path) == q


def test_spread_must_match_the_batch_sizes():
  with pytest.raises(ValueError, match="ptl_rel_se"):
    LatencyProfile(batch_sizes=(1, 2), ptl_s=(0.1, 0.2), ptl_rel_se=(0.01,))
  with pytest.raises(ValueError, match="ptl_rel_se"):
    LatencyProfile(batch_sizes=(1,), ptl_s=(0.1,), ptl_rel_se=(math.nan,))


def test_from_json_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="profile_instance"):
    LatencyProfile.from_json(tmp_path / "nope.json")


def test_paper_curve_in_seconds():
  p = LatencyProfile.from_paper()
  assert p.batch_sizes[0] == 1 and p.batch_sizes[-1] == 512
  assert p.ptl(1) == pytest.approx(0.0085)
  assert p.ptl(512) == pytest.approx(0.037)
  # Throughput (sequences per second per token) grows with the batch.
  assert all(p.ptl(b) / b > p.ptl(2 * b) / (2 * b) for b in (1, 16, 64, 256))


@pytest.mark.parametrize(
    "bs,ptl",
    [
        ((), ()),
        ((1, 2), (0.1,)),
        ((2, 1), (0.1, 0.2)),
        ((1, 1), (0.1, 0.2)),
        ((1,), (0.0,)),
        ((1,), (math.nan,)),
    ],
)
def test_bad_profiles_refused(bs, ptl):
  with pytest.raises(ValueError):
    LatencyProfile(batch_sizes=bs, ptl_s=ptl)
