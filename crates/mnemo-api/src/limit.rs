//! The per-tenant request rate limit (`MNEMO_RATE_LIMIT_PER_TENANT`, off by default): a token
//! bucket per tenant, refilled at the rate up to the burst. A request over it gets 429
//! `rate_limited` with `Retry-After`. Memory stays bounded whatever the number of tenants: a
//! bucket that has refilled is the same as none, so those are dropped first when the table is
//! full, and if every tracked tenant is active the least recently seen half goes.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mnemo_core::TenantId;

/// The most tenants tracked at once (about 100 bytes each).
pub const MAX_TRACKED_TENANTS: usize = 100_000;

#[derive(Debug)]
pub struct RateLimiter {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<TenantId, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl RateLimiter {
    /// `None` when the rate is 0 (no limit).
    pub fn new(per_second: f64, burst: f64) -> Option<Self> {
        (per_second > 0.0).then(|| Self { per_second, burst: burst.max(1.0), buckets: Mutex::default() })
    }

    /// Takes one request from the tenant's bucket, or says how long until one is available.
    pub fn check(&self, tenant: &TenantId) -> Result<(), Duration> {
        let now = Instant::now();
        // A panic elsewhere while the lock was held left the buckets whole: they are plain counts.
        let mut buckets = self.buckets.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if buckets.len() >= MAX_TRACKED_TENANTS && !buckets.contains_key(tenant) {
            self.make_room(now, &mut buckets);
        }
        let bucket = buckets.entry(tenant.clone()).or_insert(Bucket { tokens: self.burst, at: now });
        bucket.tokens = self.refilled(bucket, now);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            // A rate small enough overflows a Duration: the wait is then as long as it gets.
            Err(Duration::try_from_secs_f64((1.0 - bucket.tokens) / self.per_second).unwrap_or(Duration::MAX))
        }
    }

    /// How many tenants are tracked now.
    pub fn tracked(&self) -> usize {
        self.buckets.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    fn refilled(&self, bucket: &Bucket, now: Instant) -> f64 {
        (bucket.tokens + now.duration_since(bucket.at).as_secs_f64() * self.per_second).min(self.burst)
    }

    fn make_room(&self, now: Instant, buckets: &mut HashMap<TenantId, Bucket>) {
        buckets.retain(|_, b| self.refilled(b, now) < self.burst);
        if buckets.len() >= MAX_TRACKED_TENANTS {
            let mut seen: Vec<Instant> = buckets.values().map(|b| b.at).collect();
            seen.sort_unstable();
            let cut = seen[seen.len() / 2];
            buckets.retain(|_, b| b.at > cut);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(i: usize) -> TenantId {
        TenantId::parse(&format!("t{i}")).expect("tenant")
    }

    #[test]
    fn a_tenant_over_its_rate_waits_and_others_do_not() {
        let limiter = RateLimiter::new(10.0, 3.0).expect("on");
        for _ in 0..3 {
            limiter.check(&tenant(1)).expect("within the burst");
        }
        let wait = limiter.check(&tenant(1)).expect_err("over the burst");
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(100), "{wait:?}");
        limiter.check(&tenant(2)).expect("another tenant has its own bucket");
        assert!(RateLimiter::new(0.0, 10.0).is_none(), "0 means no limit");
    }

    /// A rate so small that its wait overflows a Duration waits as long as one gets, and does
    /// not panic (which, under the lock, would have jammed every later request).
    #[test]
    fn a_tiny_rate_waits_without_panicking() {
        let limiter = RateLimiter::new(1e-20, 1.0).expect("on");
        limiter.check(&tenant(1)).expect("the burst");
        assert_eq!(limiter.check(&tenant(1)), Err(Duration::MAX));
        assert_eq!(limiter.check(&tenant(1)), Err(Duration::MAX));
    }

    #[test]
    fn the_table_stays_bounded_with_more_tenants_than_it_holds() {
        let limiter = RateLimiter::new(1000.0, 1.0).expect("on");
        for i in 0..MAX_TRACKED_TENANTS + 10_000 {
            limiter.check(&tenant(i)).expect("each tenant's first request");
        }
        assert!(limiter.tracked() <= MAX_TRACKED_TENANTS, "{} tracked", limiter.tracked());
    }
}
