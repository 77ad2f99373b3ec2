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
    fn each_unit_starts_at_two_of_it() {
        let read = |s| duration(Duration::from_secs(s));

        assert_eq!(
            [read(0), read(119), read(120), read(7199), read(7200)],
            ["0 s", "119 s", "2 min", "119 min", "2 h"]
        );
    }
}
