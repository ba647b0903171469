//! Observed handle lifetimes: what the probes say about how long a class's handles live, and
//! whether its declared lifetime agrees.
//!
//! Every probe that answered gives the age of a handle (seconds since its record's
//! `minted_at`) at which it was still alive (`ok`: its lifetime is longer) or already gone
//! (`gone`: its lifetime is at most that age). Across sweeps a handle's probes narrow to one
//! interval, [`Bounds`]: its lifetime `T` lies in `(alive, gone]`, with `alive` 0 when it was
//! never seen alive and `gone` open when it was never seen gone (right-censored). The lifetime
//! distribution is estimated from these intervals with Turnbull's nonparametric maximum
//! likelihood estimator ([`Npmle`]), and [`check_declared`] compares a declared TTL with it.

use serde::{Deserialize, Serialize};

/// What the probes of one handle established, in seconds of age.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bounds {
    /// The oldest age at which a probe found it alive; `None` if none did.
    pub alive: Option<i64>,
    /// The youngest age at which a probe found it gone; `None` if none did.
    pub gone: Option<i64>,
}

impl Bounds {
    /// Adds one probe answer at `age` seconds: alive (`ok`) or gone.
    pub fn observe(&mut self, age: i64, alive: bool) {
        self.merge(if alive {
            Self {
                alive: Some(age),
                gone: None,
            }
        } else {
            Self {
                alive: None,
                gone: Some(age),
            }
        });
    }

    /// Combines two records of the same handle: the older alive age, the younger gone age.
    pub fn merge(&mut self, other: Self) {
        self.alive = self.alive.max(other.alive);
        self.gone = match (self.gone, other.gone) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// `(left, right)` of the censoring interval `(left, right]` in seconds (`right` `None`:
    /// unbounded), or `None` when the bounds contradict each other (seen alive at or after an
    /// age it was seen gone at: a refreshed handle, or a `minted_at` that is not the mint
    /// time), which the estimate leaves out.
    fn interval(self) -> Option<(f64, Option<f64>)> {
        let left = self.alive.unwrap_or(0).max(0) as f64;
        match self.gone {
            None => Some((left, None)),
            Some(g) if (g as f64) > left => Some((left, Some(g as f64))),
            Some(_) => None,
        }
    }
}

/// Turnbull's nonparametric maximum likelihood estimate of a lifetime distribution from
/// interval-censored observations (B. W. Turnbull, "The empirical distribution function with
/// arbitrarily grouped, censored and truncated data", J. R. Statist. Soc. B 38 (1976) 290–295).
///
/// The estimate puts all its probability on the *innermost intervals*: the intervals `(q, p]`
/// whose left end is some observation's left end, whose right end is some observation's right
/// end, and which hold no other end point (Turnbull §3). The masses are found by his
/// self-consistency algorithm (an EM algorithm): starting from equal masses,
/// `s_j ← (1/n) Σ_i α_ij s_j / Σ_k α_ik s_k`, where `α_ij` is 1 when innermost interval `j`
/// lies inside observation `i`'s interval, until no mass moves by more than [`TOLERANCE`] (or
/// after [`MAX_ITERATIONS`]). Each observation covers a contiguous run of innermost intervals,
/// so one iteration costs O(n + m) with prefix sums instead of O(n·m).
///
/// Within an innermost interval the likelihood does not say where the mass lies; quantiles
/// ([`Npmle::quantile`]) spread it evenly over the interval. Mass on an interval with no right
/// end (`(q, ∞)`: beyond every handle still alive) has no location at all.
#[derive(Clone, Debug, PartialEq)]
pub struct Npmle {
    /// The innermost intervals `(q, p]` in order, `p` `None` for `(q, ∞)`.
    pub support: Vec<(f64, Option<f64>)>,
    /// The probability of each, summing to 1 (empty with `support` when there were no
    /// consistent observations).
    pub mass: Vec<f64>,
    /// Observations used (those with consistent bounds).
    pub used: usize,
}

/// Self-consistency stops once no mass changes by more than this in one iteration.
pub const TOLERANCE: f64 = 1e-9;
/// Self-consistency stops after this many iterations at the latest.
pub const MAX_ITERATIONS: usize = 20_000;

/// Where a quantile of the lifetime lies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Quantile {
    /// At this many seconds.
    At(f64),
    /// Beyond this many seconds (the oldest age a handle was seen alive at), by an amount the
    /// observations do not bound.
    Beyond(f64),
}

impl Quantile {
    /// The quantile in whole seconds (rounded down) when the observations locate it.
    pub fn seconds(self) -> Option<u64> {
        match self {
            Self::At(s) => Some(s.max(0.0).floor() as u64),
            Self::Beyond(_) => None,
        }
    }
}

impl Npmle {
    /// Estimates from the observations; those whose bounds contradict each other are left out.
    pub fn fit(observations: &[Bounds]) -> Self {
        let intervals: Vec<(f64, Option<f64>)> =
            observations.iter().filter_map(|b| b.interval()).collect();
        let support = innermost(&intervals);
        if support.is_empty() {
            return Self {
                support,
                mass: Vec::new(),
                used: 0,
            };
        }
        // The run of innermost intervals inside each observation: (first, last), inclusive.
        let runs: Vec<(usize, usize)> = intervals
            .iter()
            .map(|&(l, r)| {
                let first = support.partition_point(|&(q, _)| q < l);
                let last = support.partition_point(|&(_, p)| match (p, r) {
                    (_, None) => true,
                    (None, Some(_)) => false,
                    (Some(p), Some(r)) => p <= r,
                }) - 1;
                (first, last)
            })
            .collect();
        let m = support.len();
        let n = intervals.len() as f64;
        let mut mass = vec![1.0 / m as f64; m];
        let mut prefix = vec![0.0; m + 1];
        let mut weight = vec![0.0; m + 1];
        for _ in 0..MAX_ITERATIONS {
            for j in 0..m {
                prefix[j + 1] = prefix[j] + mass[j];
            }
            weight.iter_mut().for_each(|w| *w = 0.0);
            for &(a, b) in &runs {
                let covered = prefix[b + 1] - prefix[a];
                if covered > 0.0 {
                    weight[a] += 1.0 / covered;
                    weight[b + 1] -= 1.0 / covered;
                }
            }
            let mut running = 0.0;
            let mut moved: f64 = 0.0;
            for j in 0..m {
                running += weight[j];
                let next = mass[j] * running / n;
                moved = moved.max((next - mass[j]).abs());
                mass[j] = next;
            }
            if moved <= TOLERANCE {
                break;
            }
        }
        Self {
            support,
            mass,
            used: intervals.len(),
        }
    }

    /// The estimated probability that a handle is gone by age `t` seconds (mass spread evenly
    /// within each innermost interval, as [`Npmle::quantile`] does).
    pub fn cdf(&self, t: f64) -> f64 {
        self.support
            .iter()
            .zip(&self.mass)
            .map(|(&(q, p), &s)| match p {
                _ if t <= q => 0.0,
                Some(p) if t < p => s * (t - q) / (p - q),
                Some(_) => s,
                None => 0.0,
            })
            .sum()
    }

    /// The `u`-quantile (`0 < u < 1`): the age by which a share `u` of handles is estimated to
    /// be gone. `None` without observations.
    pub fn quantile(&self, u: f64) -> Option<Quantile> {
        let mut below = 0.0;
        for (&(q, p), &s) in self.support.iter().zip(&self.mass) {
            if s > 0.0 && below + s >= u {
                return Some(match p {
                    Some(p) => Quantile::At(q + (p - q) * ((u - below) / s).clamp(0.0, 1.0)),
                    None => Quantile::Beyond(q),
                });
            }
            below += s;
        }
        // Rounding left the total a hair under u: the last interval with mass holds it.
        let (j, _) = self.mass.iter().enumerate().rfind(|(_, s)| **s > 0.0)?;
        let (q, p) = self.support[j];
        Some(p.map_or(Quantile::Beyond(q), Quantile::At))
    }
}

/// Turnbull's innermost intervals of `(l, r]` intervals, in order: sort every end point, a
/// right end before a left end at the same value (a point `x` belongs to `(l, r]` when
/// `l < x <= r`), and take each left end immediately followed by a right end.
fn innermost(intervals: &[(f64, Option<f64>)]) -> Vec<(f64, Option<f64>)> {
    // (value, 0 = right end / 1 = left end); an open right end sorts last.
    let mut ends: Vec<(f64, u8)> = Vec::with_capacity(intervals.len() * 2);
    for &(l, r) in intervals {
        ends.push((l, 1));
        ends.push((r.unwrap_or(f64::INFINITY), 0));
    }
    ends.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    ends.windows(2)
        .filter(|w| w[0].1 == 1 && w[1].1 == 0)
        .map(|w| (w[0].0, w[1].0.is_finite().then_some(w[1].0)))
        .collect()
}

/// Observations below which no quantile is reported and the declared TTL is not judged:
/// at least this many handles with consistent bounds...
pub const MIN_HANDLES: u64 = 20;
/// ...of which at least this many were found gone (without deaths no low quantile exists).
pub const MIN_GONE: u64 = 5;

/// The figures of a class's observed lifetime, as `status.observedLifetime` shows them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Handles with consistent bounds.
    pub handles: u64,
    /// Of those, handles found gone at least once.
    pub gone: u64,
    /// Handles left out because their bounds contradict each other.
    pub inconsistent: u64,
    /// Estimated 5th, 50th and 95th percentile lifetime, whole seconds; `None` with fewer than
    /// [`MIN_HANDLES`] handles or [`MIN_GONE`] gone, or when the quantile lies beyond the
    /// oldest handle seen alive.
    pub p5: Option<u64>,
    /// See `p5`.
    pub p50: Option<u64>,
    /// See `p5`.
    pub p95: Option<u64>,
    /// The oldest age at which a handle was seen alive.
    pub oldest_alive: Option<i64>,
    /// The youngest age at which a handle was found gone.
    pub youngest_gone: Option<i64>,
}

impl Summary {
    /// Fits [`Npmle`] to the observations and reads the figures off it.
    pub fn of(observations: &[Bounds]) -> Self {
        let fit = Npmle::fit(observations);
        let consistent = || observations.iter().filter(|b| b.interval().is_some());
        let handles = fit.used as u64;
        let gone = consistent().filter(|b| b.gone.is_some()).count() as u64;
        let enough = handles >= MIN_HANDLES && gone >= MIN_GONE;
        let q = |u| {
            enough
                .then(|| fit.quantile(u))
                .flatten()
                .and_then(Quantile::seconds)
        };
        Self {
            handles,
            gone,
            inconsistent: observations.len() as u64 - handles,
            p5: q(0.05),
            p50: q(0.5),
            p95: q(0.95),
            oldest_alive: consistent().filter_map(|b| b.alive).max(),
            youngest_gone: consistent().filter_map(|b| b.gone).min(),
        }
    }
}

/// A declared TTL is suggested as this share of the estimated 5th percentile lifetime,
/// rounded down: the lifetime by which 5 % of handles are already gone, with a 20 % margin for
/// the estimate's own error and for servers whose lifetimes drift.
pub const SUGGESTION_FACTOR: f64 = 0.8;

/// How a declared TTL compares with the observations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plausibility {
    /// Fewer than [`MIN_HANDLES`] handles or [`MIN_GONE`] found gone: nothing to judge by.
    TooFew {
        /// Handles observed.
        handles: u64,
        /// Of those, found gone.
        gone: u64,
    },
    /// The declared TTL is not longer than the observations support.
    Plausible,
    /// No handle was seen alive at the TTL's age or older, and none found gone younger than it
    /// in numbers that show it too long: custody probes handles younger than their TTL only as
    /// a small sample each sweep (none with the sample turned off), so a TTL declared before
    /// any observation hides most of the ages that would show it too long (every unsampled
    /// handle then answers `gone` at its first probe). Nothing to judge by.
    Unseen {
        /// The oldest age a handle was seen alive at, seconds (below the TTL), if any.
        oldest_alive: Option<i64>,
    },
    /// Handles were found gone younger than the declared TTL, and more than 5 % of handles are
    /// estimated to be gone by then (the estimated p5 is below it).
    TooLong {
        /// The estimated 5th percentile lifetime, seconds.
        p5: u64,
        /// The youngest age a handle was found gone at, seconds.
        youngest_gone: i64,
        /// [`SUGGESTION_FACTOR`] × `p5`, rounded down: a value to consider, never applied.
        suggested: u64,
    },
}

/// Judges a declared TTL of `declared` seconds against a class's [`Summary`].
///
/// The rule: a TTL makes custody treat a handle as alive, unprobed, until it is that old, so it
/// is too long when handles were found gone younger than it (`youngest_gone < declared`, hard
/// evidence, not only the estimate's) and the estimated 5th percentile lifetime is below it
/// (more than one handle in 20 would be treated as alive when it is gone). The deaths younger
/// than the TTL are only seen through the sweeps' sample probes of young handles: without them
/// a class whose handles partly die before the TTL and partly outlive it reads plausible, since
/// an early death then shows only as `gone` at the first probe past the TTL, which says
/// nothing about when before it the handle died. It is consistent
/// only when some handle was seen alive at the TTL's age or older ([`Plausibility::Unseen`]
/// otherwise): a TTL that hid every younger age must not read as confirmed. A summary whose p5
/// lies beyond every handle seen alive (`p5` `None` with enough observations) supports any TTL
/// it reached.
pub fn check_declared(declared: u64, s: &Summary) -> Plausibility {
    if s.handles < MIN_HANDLES || s.gone < MIN_GONE {
        return Plausibility::TooFew {
            handles: s.handles,
            gone: s.gone,
        };
    }
    match (s.p5, s.youngest_gone) {
        (Some(p5), Some(youngest)) if youngest < declared as i64 && p5 < declared => {
            Plausibility::TooLong {
                p5,
                youngest_gone: youngest,
                suggested: (p5 as f64 * SUGGESTION_FACTOR).floor() as u64,
            }
        }
        _ if s.oldest_alive.is_none_or(|a| a < declared as i64) => Plausibility::Unseen {
            oldest_alive: s.oldest_alive,
        },
        _ => Plausibility::Plausible,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(alive: Option<i64>, gone: Option<i64>) -> Bounds {
        Bounds { alive, gone }
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn a_ttl_that_hid_every_younger_age_is_not_confirmed() {
        // Declared 3600 s from the start, lifetime 1800 s: every handle is first probed at
        // 3600 s or later and is gone by then.
        let hidden: Vec<Bounds> = (0..30).map(|i| b(None, Some(3600 + i))).collect();
        assert_eq!(
            check_declared(3600, &Summary::of(&hidden)),
            Plausibility::Unseen { oldest_alive: None }
        );
        // Lifetime 7200 s under the same TTL: seen alive past it, so it is confirmed.
        let alive: Vec<Bounds> = (0..30).map(|i| b(Some(3600 + i), Some(7300))).collect();
        assert_eq!(
            check_declared(3600, &Summary::of(&alive)),
            Plausibility::Plausible
        );
    }

    #[test]
    fn bounds_keep_the_oldest_alive_and_the_youngest_gone() {
        let mut x = Bounds::default();
        x.observe(100, true);
        x.observe(300, true);
        x.observe(200, true);
        x.observe(900, false);
        x.observe(500, false);
        assert_eq!(x, b(Some(300), Some(500)));
        assert_eq!(x.interval(), Some((300.0, Some(500.0))));
        assert_eq!(b(Some(500), Some(500)).interval(), None);
        assert_eq!(b(None, Some(40)).interval(), Some((0.0, Some(40.0))));
    }

    #[test]
    fn exact_lifetimes_give_the_empirical_distribution() {
        // A handle seen alive one second before it was found gone: an exact lifetime. The
        // NPMLE of exact data is the empirical distribution (mass 1/n on each lifetime).
        let lifetimes = [100, 200, 300, 400];
        let obs: Vec<Bounds> = lifetimes.iter().map(|&t| b(Some(t - 1), Some(t))).collect();
        let fit = Npmle::fit(&obs);
        assert_eq!(fit.support.len(), 4);
        for s in &fit.mass {
            assert!(close(*s, 0.25, 1e-12), "{:?}", fit.mass);
        }
        assert!(close(fit.cdf(250.0), 0.5, 1e-12));
        assert_eq!(fit.quantile(0.5), Some(Quantile::At(200.0)));
        assert_eq!(fit.quantile(0.75), Some(Quantile::At(300.0)));
    }

    #[test]
    fn all_right_censored_puts_everything_beyond_the_oldest_alive() {
        let obs = [b(Some(50), None), b(Some(80), None), b(Some(20), None)];
        let fit = Npmle::fit(&obs);
        assert_eq!(fit.support, vec![(80.0, None)]);
        assert_eq!(fit.mass, vec![1.0]);
        assert_eq!(fit.cdf(80.0), 0.0);
        assert_eq!(fit.quantile(0.05), Some(Quantile::Beyond(80.0)));
        assert_eq!(Quantile::Beyond(80.0).seconds(), None);
    }

    #[test]
    fn overlapping_intervals_share_their_innermost_interval() {
        // (0,2] and (1,3] overlap in (1,2]: all the mass goes there.
        let fit = Npmle::fit(&[b(None, Some(2)), b(Some(1), Some(3))]);
        assert_eq!(fit.support, vec![(1.0, Some(2.0))]);
        assert_eq!(fit.mass, vec![1.0]);
        // (0,1], (2,3] and (0,3]: two innermost intervals, by symmetry half each.
        let fit = Npmle::fit(&[b(None, Some(1)), b(Some(2), Some(3)), b(None, Some(3))]);
        assert_eq!(fit.support, vec![(0.0, Some(1.0)), (2.0, Some(3.0))]);
        assert!(close(fit.mass[0], 0.5, 1e-9) && close(fit.mass[1], 0.5, 1e-9));
    }

    #[test]
    fn right_censoring_moves_mass_like_kaplan_meier() {
        // Exact deaths at 10 and 30, one handle alive at 20 and never seen again: the NPMLE
        // equals the Kaplan–Meier estimate, S(10) = 2/3, S(30) = 0 → masses 1/3 at 10, 2/3
        // at 30 (the censored handle's share moves to the later death).
        let obs = [
            b(Some(9), Some(10)),
            b(Some(20), None),
            b(Some(29), Some(30)),
        ];
        let fit = Npmle::fit(&obs);
        assert_eq!(fit.support, vec![(9.0, Some(10.0)), (29.0, Some(30.0))]);
        assert!(close(fit.mass[0], 1.0 / 3.0, 1e-6), "{:?}", fit.mass);
        assert!(close(fit.mass[1], 2.0 / 3.0, 1e-6), "{:?}", fit.mass);
    }

    #[test]
    fn contradictory_bounds_are_left_out() {
        let s = Summary::of(&[b(Some(10), Some(5)), b(Some(1), Some(2))]);
        assert_eq!((s.handles, s.inconsistent, s.gone), (1, 1, 1));
        assert_eq!(s.p50, None, "too few handles for a quantile");
        assert_eq!(Npmle::fit(&[]).quantile(0.5), None);
    }

    /// Current-status data (every handle probed once, at ages spread evenly over 0..2L): a
    /// fixed lifetime L shows as the ages alive below it and gone above it.
    #[test]
    fn a_fixed_lifetime_is_recovered_from_single_probes() {
        let l = 1000;
        let obs: Vec<Bounds> = (0..200)
            .map(|i| {
                let age = 5 + i * 10;
                if age < l {
                    b(Some(age), None)
                } else {
                    b(None, Some(age))
                }
            })
            .collect();
        let s = Summary::of(&obs);
        for q in [s.p5, s.p50, s.p95] {
            let q = q.unwrap() as i64;
            assert!((q - l).abs() <= 10, "{s:?}");
        }
        assert_eq!((s.oldest_alive, s.youngest_gone), (Some(995), Some(1005)));
    }

    /// A mixture: 30 % of handles die at 1 000 s, the rest at 8 000 s, under a declared TTL of
    /// 3 600 s, swept every 300 s. Unsampled, every handle is first probed at 3 600–3 900 s.
    /// Sampled, the first 10 handles (3 early deaths among them) are probed from minting on.
    #[test]
    fn early_deaths_seen_by_the_sample_show_a_mixture_s_ttl_too_long() {
        let first_probe = |i: i64| 3600 + (i * 7) % 300;
        let early = |i: i64| i % 10 < 3;
        let unsampled = |i: i64| {
            if early(i) {
                b(None, Some(first_probe(i)))
            } else {
                b(Some(7800 + (i * 7) % 200), Some(8000 + (i * 7) % 200))
            }
        };
        let sampled = |i: i64| match (i < 10, early(i)) {
            (true, true) => b(Some(900 + i), Some(1100 + i)),
            _ => unsampled(i),
        };
        let late_only: Vec<Bounds> = (0..40).map(unsampled).collect();
        let with_sample: Vec<Bounds> = (0..40).map(sampled).collect();
        // (case, observations, declared TTL, expected verdict's kind)
        let cases: [(&str, &[Bounds], u64, &str); 4] = [
            ("late probes only: the gap", &late_only, 3600, "plausible"),
            ("the sample's early deaths", &with_sample, 3600, "too long"),
            (
                "a TTL below the early deaths",
                &with_sample,
                600,
                "plausible",
            ),
            ("a TTL between the deaths", &with_sample, 1050, "plausible"),
        ];
        for (case, obs, declared, want) in cases {
            let got = match check_declared(declared, &Summary::of(obs)) {
                Plausibility::TooLong { youngest_gone, .. } => {
                    assert_eq!(youngest_gone, 1100, "{case}");
                    "too long"
                }
                Plausibility::Plausible => "plausible",
                Plausibility::Unseen { .. } => "unseen",
                Plausibility::TooFew { .. } => "too few",
            };
            assert_eq!(got, want, "{case}: {:?}", Summary::of(obs));
        }
    }

    fn summary(p5: u64, youngest_gone: i64) -> Summary {
        Summary {
            handles: 40,
            gone: 10,
            p5: Some(p5),
            youngest_gone: Some(youngest_gone),
            oldest_alive: Some(5000),
            ..Summary::default()
        }
    }

    #[test]
    fn a_declared_ttl_is_too_long_only_with_deaths_younger_than_it() {
        assert_eq!(
            check_declared(3600, &summary(1000, 990)),
            Plausibility::TooLong {
                p5: 1000,
                youngest_gone: 990,
                suggested: 800
            }
        );
        assert_eq!(
            check_declared(900, &summary(1000, 990)),
            Plausibility::Plausible
        );
        // Gone younger than declared, but fewer than 5 % estimated by then.
        assert_eq!(
            check_declared(1000, &summary(1200, 990)),
            Plausibility::Plausible
        );
        let few = Summary {
            gone: 4,
            ..summary(1000, 990)
        };
        assert_eq!(
            check_declared(3600, &few),
            Plausibility::TooFew {
                handles: 40,
                gone: 4
            }
        );
    }
}
