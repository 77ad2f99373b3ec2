//! How values read to people, in one voice: a status table, a row's
//! detail and a log line say "42 s", "5 min", "3 h" alike.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A duration, rounded down to its largest whole unit past two of the
/// next: seconds under 2 min, minutes under 2 h, hours after that.
pub fn duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        _ => format!("{} h", s / 3600),
    }
}

/// A size on disk, in the unit it reads best in: "72 KiB", "65.0 MiB",
/// "1.0 GiB".
pub fn bytes(n: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    match n {
        0..KIB => format!("{n} B"),
        KIB..MIB => format!("{} KiB", n / KIB),
        MIB..GIB => format!("{:.1} MiB", n as f64 / MIB as f64),
        _ => format!("{:.1} GiB", n as f64 / GIB as f64),
    }
}

/// How a process ended: "exit status 1", "killed by signal 9".
pub fn exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => "unknown status".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moment_to_come_reads_as_how_long_and_when_in_utc() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);

        let said = when_at_offset(now + Duration::from_secs(23 * 3600 + 60), now, 0);

        assert_eq!(said, "in 23 h (2027-01-16T07:01Z)");
    }

    #[test]
    fn a_moment_in_utc_to_the_millisecond_reads_as_the_log_stamps_it() {
        let t = UNIX_EPOCH + Duration::from_millis(1_800_000_007_042);

        assert_eq!(utc_millis(t), "2027-01-15T08:00:07.042Z");
    }

    #[test]
    fn a_moment_reads_in_the_local_time_of_its_offset() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let at = now + Duration::from_secs(23 * 3600 + 60);

        let east = when_at_offset(at, now, 3600);
        let west = when_at_offset(at, now, -(3 * 3600 + 1800));

        assert_eq!(east, "in 23 h (2027-01-16T08:01+01:00)");
        assert_eq!(west, "in 23 h (2027-01-16T03:31-03:30)");
    }

    #[test]
    fn the_local_offset_is_the_one_date_gives() {
        let at = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let out = std::process::Command::new("date")
            .args(["-d", "@1800000000", "+%z"])
            .output()
            .expect("date runs");
        let text = String::from_utf8_lossy(&out.stdout);
        let (sign, digits) = text.trim().split_at(1);
        let hhmm: i64 = digits.parse().expect("an offset");
        let from_date = (hhmm / 100 * 3600 + hhmm % 100 * 60) * if sign == "-" { -1 } else { 1 };

        assert_eq!(local_offset(at), from_date);
    }

    #[test]
    fn a_moment_past_reads_now() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);

        let said = when_at_offset(now - Duration::from_secs(5), now, 0);

        assert_eq!(said, "now (2027-01-15T07:59Z)");
    }

    #[test]
    fn an_exit_reads_the_same_from_every_program() {
        assert_eq!(exit(ExitStatus::from_raw(3 << 8)), "exit status 3");
        assert_eq!(exit(ExitStatus::from_raw(9)), "killed by signal 9");
    }

    #[test]
    fn a_size_reads_in_its_largest_whole_unit() {
        assert_eq!(
            [bytes(512), bytes(73_728), bytes(68_157_440), bytes(1 << 30)],
            ["512 B", "72 KiB", "65.0 MiB", "1.0 GiB"]
        );
    }

    #[test]
    fn each_unit_starts_at_two_of_it() {
        let read = |s| duration(Duration::from_secs(s));

        assert_eq!(
            [read(0), read(119), read(120), read(7199), read(7200)],
            ["0 s", "119 s", "2 min", "119 min", "2 h"]
        );
    }
}

/// `t` in Unix milliseconds, as records, reports and the wire keep
/// moments (0 before 1970).
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A moment as a UTC calendar time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Utc {
    pub year: i64,
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

impl Utc {
    pub fn from(t: SystemTime) -> Utc {
        let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
        let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        Utc {
            year,
            month,
            day,
            hour: (rest / 3600) as u32,
            minute: (rest % 3600 / 60) as u32,
            second: (rest % 60) as u32,
        }
    }
}

impl std::fmt::Display for Utc {
    /// ISO 8601 to the minute: "2026-12-05T14:03Z".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02}T{:02}:{:02}Z",
            self.year, self.month, self.day, self.hour, self.minute
        )
    }
}

/// `t` in UTC to the millisecond, as the log stamps its lines:
/// "2026-12-05T14:03:07.042Z" (sorts as text).
pub fn utc_millis(t: SystemTime) -> String {
    let u = Utc::from(t);
    let ms = t
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_millis());
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        u.year, u.month, u.day, u.hour, u.minute, u.second
    )
}

/// A moment to come, as an operator reads it, in the host's local time:
/// "in 23 h (2026-12-05T15:03+01:00)"; one past, "now (…)". UTC reads
/// "…Z".
pub fn when(at: SystemTime, now: SystemTime) -> String {
    when_at_offset(at, now, local_offset(at))
}

/// [`when`] at a UTC offset of `offset_s` seconds.
fn when_at_offset(at: SystemTime, now: SystemTime, offset_s: i64) -> String {
    let shifted = if offset_s >= 0 {
        at.checked_add(Duration::from_secs(offset_s.unsigned_abs()))
    } else {
        at.checked_sub(Duration::from_secs(offset_s.unsigned_abs()))
    }
    .unwrap_or(at);
    let t = Utc::from(shifted);
    let stamp = format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}{}",
        t.year,
        t.month,
        t.day,
        t.hour,
        t.minute,
        zone(offset_s)
    );
    match at.duration_since(now) {
        Ok(left) => format!("in {} ({stamp})", duration(left)),
        Err(_) => format!("now ({stamp})"),
    }
}

/// ISO 8601's zone designator for a UTC offset: "Z", "+01:00", "-03:30".
fn zone(offset_s: i64) -> String {
    if offset_s == 0 {
        return "Z".into();
    }
    let sign = if offset_s < 0 { '-' } else { '+' };
    let m = offset_s.unsigned_abs() / 60;
    format!("{sign}{:02}:{:02}", m / 60, m % 60)
}

/// The host's UTC offset at `at`, in seconds, as its C library has it
/// (`TZ`, else `/etc/localtime`); 0 when it cannot say.
fn local_offset(at: SystemTime) -> i64 {
    let secs = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    // time_t is an i64 on every target the agent builds for (musl
    // included), which the call below holds it to.
    let Ok(time) = i64::try_from(secs) else {
        return 0;
    };
    // SAFETY: `tm` is plain data, zeroed; localtime_r writes only into
    // it and reads only `time`, both live for the call.
    let mut tm: nix::libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: as above; a null return leaves `tm` as it was.
    let filled = unsafe { nix::libc::localtime_r(&time, &mut tm) };
    if filled.is_null() {
        return 0;
    }
    tm.tm_gmtoff
}
