//! When each request is sent: open-loop arrivals (Poisson / gamma, optionally ramping), following the
//! rules of `vllm bench serve` so that the same flags give the same traffic shape.

use rand::rngs::StdRng;
use rand_distr::{Distribution, Gamma};

use crate::args::RampUp;
use crate::error::{BenchError, Result};

/// The arrival process of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArrivalProcess {
    /// Requests per second; `f64::INFINITY` sends all at once.
    pub request_rate: f64,
    /// Gamma shape: 1 is Poisson, `inf` is a constant interval.
    pub burstiness: f64,
    /// Linear or exponential ramp from `start` to `end` requests per second over the run.
    pub ramp_up: Option<(RampUp, f64, f64)>,
}

impl ArrivalProcess {
    /// Validates the combination of flags.
    pub fn new(
        request_rate: f64,
        burstiness: f64,
        ramp_up: Option<(RampUp, f64, f64)>,
    ) -> Result<Self> {
        let invalid = |m: &str| Err(BenchError::InvalidArgument(m.to_string()));
        if request_rate.is_nan() || request_rate <= 0.0 {
            return invalid("--request-rate must be > 0 (or inf)");
        }
        if burstiness.is_nan() || burstiness <= 0.0 {
            return invalid("--burstiness must be > 0");
        }
        if let Some((strategy, start, end)) = ramp_up {
            if request_rate.is_finite() {
                return invalid(
                    "--ramp-up-strategy controls the rate; do not also pass --request-rate",
                );
            }
            if start < 0.0 || end < start || end == 0.0 {
                return invalid(
                    "ramp-up needs 0 <= --ramp-up-start-rps <= --ramp-up-end-rps, end > 0",
                );
            }
            if strategy == RampUp::Exponential && start == 0.0 {
                return invalid("exponential ramp-up needs --ramp-up-start-rps > 0");
            }
        }
        Ok(Self {
            request_rate,
            burstiness,
            ramp_up,
        })
    }

    /// Rate in effect for request `index` of `total`.
    pub fn rate_at(&self, index: usize, total: usize) -> f64 {
        match self.ramp_up {
            None => self.request_rate,
            Some((strategy, start, end)) => {
                let progress = index as f64 / total.saturating_sub(1).max(1) as f64;
                match strategy {
                    RampUp::Linear => start + (end - start) * progress,
                    RampUp::Exponential => start * (end / start).powf(progress),
                }
            }
        }
    }

    /// Gap before one request at `rate`.
    fn interval(&self, rate: f64, rng: &mut StdRng) -> f64 {
        if rate.is_infinite() {
            0.0
        } else if rate <= 0.0 {
            // A linear ramp starting at 0 rps: the very first request goes out immediately.
            0.0
        } else if self.burstiness.is_infinite() {
            1.0 / rate
        } else {
            // Mean of Gamma(k, θ) is kθ = 1/rate; variance shrinks as k grows.
            let theta = 1.0 / (rate * self.burstiness);
            Gamma::new(self.burstiness, theta)
                .map(|g| g.sample(rng))
                .unwrap_or(1.0 / rate)
        }
    }

    /// Send offsets (seconds from the start) for `total` requests. Without a ramp the offsets are
    /// rescaled so the last one lands at exactly `total / rate`, as vLLM does, which removes the
    /// 1–2% run-to-run throughput noise of a raw random sum.
    pub fn offsets(&self, total: usize, rng: &mut StdRng) -> Vec<f64> {
        let mut t = 0.0;
        let mut out: Vec<f64> = (0..total)
            .map(|i| {
                t += self.interval(self.rate_at(i, total), rng);
                t
            })
            .collect();
        if self.ramp_up.is_none() && self.request_rate.is_finite() {
            if let Some(&last) = out.last() {
                if last > 0.0 {
                    let scale = (total as f64 / self.request_rate) / last;
                    out.iter_mut().for_each(|o| *o *= scale);
                }
            }
        }
        out
    }

    /// Offset of the next request in an open-ended (`--duration`) run, given the previous offset.
    pub fn next_offset(&self, prev: f64, rng: &mut StdRng) -> f64 {
        prev + self.interval(self.request_rate, rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn gaps(offsets: &[f64]) -> Vec<f64> {
        let mut prev = 0.0;
        offsets
            .iter()
            .map(|&o| {
                let g = o - prev;
                prev = o;
                g
            })
            .collect()
    }

    fn cv(xs: &[f64]) -> f64 {
        let m = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / xs.len() as f64;
        var.sqrt() / m
    }

    #[test]
    fn poisson_has_target_rate_and_unit_cv() {
        let p = ArrivalProcess::new(50.0, 1.0, None).unwrap();
        let offs = p.offsets(20_000, &mut StdRng::seed_from_u64(0));
        assert!(
            (offs.last().unwrap() - 400.0).abs() < 1e-6,
            "rescaled to n/rate"
        );
        let c = cv(&gaps(&offs));
        assert!(
            (c - 1.0).abs() < 0.05,
            "exponential gaps have CV 1, got {c}"
        );
    }

    #[test]
    fn burstiness_controls_dispersion() {
        // Gamma(k) gaps have CV = 1/sqrt(k).
        let bursty = ArrivalProcess::new(10.0, 0.25, None).unwrap();
        let smooth = ArrivalProcess::new(10.0, 4.0, None).unwrap();
        let cb = cv(&gaps(
            &bursty.offsets(20_000, &mut StdRng::seed_from_u64(1)),
        ));
        let cs = cv(&gaps(
            &smooth.offsets(20_000, &mut StdRng::seed_from_u64(1)),
        ));
        assert!((cb - 2.0).abs() < 0.15, "{cb}");
        assert!((cs - 0.5).abs() < 0.05, "{cs}");
    }

    #[test]
    fn infinite_rate_sends_at_once() {
        let p = ArrivalProcess::new(f64::INFINITY, 1.0, None).unwrap();
        assert!(p
            .offsets(10, &mut StdRng::seed_from_u64(0))
            .iter()
            .all(|&o| o == 0.0));
    }

    #[test]
    fn linear_ramp_rises() {
        let p = ArrivalProcess::new(
            f64::INFINITY,
            f64::INFINITY,
            Some((RampUp::Linear, 1.0, 9.0)),
        )
        .unwrap();
        assert_eq!(p.rate_at(0, 5), 1.0);
        assert_eq!(p.rate_at(2, 5), 5.0);
        assert_eq!(p.rate_at(4, 5), 9.0);
        let e = ArrivalProcess::new(f64::INFINITY, 1.0, Some((RampUp::Exponential, 1.0, 16.0)))
            .unwrap();
        assert!((e.rate_at(2, 5) - 4.0).abs() < 1e-9);
    }

    #[test]
    fn rejects_bad_flags() {
        assert!(ArrivalProcess::new(0.0, 1.0, None).is_err());
        assert!(ArrivalProcess::new(1.0, -1.0, None).is_err());
        assert!(ArrivalProcess::new(5.0, 1.0, Some((RampUp::Linear, 1.0, 2.0))).is_err());
        assert!(
            ArrivalProcess::new(f64::INFINITY, 1.0, Some((RampUp::Exponential, 0.0, 2.0))).is_err()
        );
    }
}
