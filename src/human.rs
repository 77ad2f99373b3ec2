//! How values read to people, in one voice: a status table, a row's
//! detail and a log line say "42 s", "5 min", "3 h" alike.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

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
