//! A tenant's time zone (`tenant_config.settings.time_zone`, an IANA name such as
//! `Europe/Paris`; UTC when unset or unknown): which day a daily note belongs to, which notes a
//! prompt calls today's and recent, and when the consolidation schedule fires. Names and
//! arithmetic are PostgreSQL's tz database (SQL function `tenant_time_zone`), so mnemo ships no
//! second copy.

use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use mnemo_core::TenantId;

use crate::{Store, StoreError};

/// Every zone some tenant is in (UTC always), with the wall-clock time there now. Each name
/// stored is checked once, through one tenant that holds it, not once a tenant: the check is a
/// subtransaction, and this runs at every housekeeping tick.
const ZONE_CLOCKS: &str = "
SELECT zone, now() AT TIME ZONE zone FROM (
    SELECT tenant_time_zone(min(tenant_id)) AS zone FROM tenant_config WHERE settings ? 'time_zone'
    GROUP BY settings ->> 'time_zone'
    UNION SELECT 'UTC'
) zones ORDER BY zone";

/// Whether `name` has the shape of a region's zone (`Europe/Paris`, or `UTC`), not an abbreviation
/// or a fixed offset (`PST`, `+05`, `Etc/GMT+5`), which ignore daylight saving time, nor a name
/// PostgreSQL would read as a POSIX rule, sign inverted (`UTC+3`, `Asia/Tokyo+9`): no region's
/// name holds a digit or a `+`. Whether PostgreSQL knows the name is its own check.
pub(crate) fn is_region_zone(name: &str) -> bool {
    let mut parts = name.split('/');
    let region = parts.next().unwrap_or_default();
    let places: Vec<&str> = parts.collect();
    let word = |s: &str, extra: &[char]| {
        !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || extra.contains(&c))
    };
    name == "UTC"
        || (!places.is_empty()
            && region != "Etc"
            && !name.contains(|c: char| c.is_ascii_digit() || c == '+')
            && word(region, &[])
            && places.iter().all(|p| word(p, &['-'])))
}

impl Store {
    /// Sets the tenant's time zone. False, changing nothing, when PostgreSQL does not know the
    /// name (abbreviations and fixed offsets such as `PST`, `+05` or `Etc/GMT+5` are refused
    /// too: they ignore daylight saving time).
    pub async fn set_time_zone(&self, tenant: &TenantId, zone: &str) -> Result<bool, StoreError> {
        if !is_region_zone(zone) {
            return Ok(false);
        }
        let set = sqlx::query(
            "INSERT INTO tenant_config (tenant_id, settings)
             SELECT $1, jsonb_build_object('time_zone', $2::text)
             WHERE EXISTS (SELECT 1 FROM pg_timezone_names WHERE name = $2)
             ON CONFLICT (tenant_id) DO UPDATE
             SET settings = tenant_config.settings || EXCLUDED.settings, updated_at = now()",
        )
        .bind(tenant.as_str())
        .bind(zone)
        .execute(&self.pool)
        .await?;
        Ok(set.rows_affected() == 1)
    }

    /// The tenant's time zone and today's date there.
    pub async fn tenant_today(&self, tenant: &TenantId) -> Result<(String, NaiveDate), StoreError> {
        self.tenant_day(tenant, Utc::now()).await
    }

    /// The tenant's time zone and the date there at `at`.
    pub async fn tenant_day(&self, tenant: &TenantId, at: DateTime<Utc>) -> Result<(String, NaiveDate), StoreError> {
        Ok(sqlx::query_as("SELECT zone, ($2::timestamptz AT TIME ZONE zone)::date FROM tenant_time_zone($1) AS zone")
            .bind(tenant.as_str())
            .bind(at)
            .fetch_one(&mut *self.tenant_connection([tenant.as_str()]).await?)
            .await?)
    }

    /// Every zone some tenant is in (UTC always), with the wall-clock time there now.
    pub async fn zone_clocks(&self) -> Result<Vec<(String, NaiveDateTime)>, StoreError> {
        Ok(sqlx::query_as(ZONE_CLOCKS).fetch_all(&self.pool).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::is_region_zone;

    #[test]
    fn only_regions_zones_have_the_shape() {
        for zone in ["UTC", "Europe/Paris", "America/Argentina/Buenos_Aires", "America/Port-au-Prince"] {
            assert!(is_region_zone(zone), "{zone}");
        }
        for zone in [
            "",
            "PST",
            "+05",
            "UTC+3",
            "Etc/GMT+5",
            "posix/Etc/GMT+5",
            "Asia/Tokyo+9",
            "Europe/Paris-1",
            "EST5EDT",
            "Europe/",
            "/Paris",
            "Europe/Pa ris",
        ] {
            assert!(!is_region_zone(zone), "{zone}");
        }
    }
}
