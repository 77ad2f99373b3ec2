//! What a running VM uses, read for `top`, `status VM` and the metrics
//! file (see [`Meters`]). Per VM, per reading: its pidfile and its VMM's
//! `/proc/<pid>/stat` (alive, the recorded process, its CPU time and
//! resident memory), its cgroup's CPU time where the host counts it
//! there, and its VMM's `vm.counters` (bytes and requests per disk and
//! NIC), or its taps' counters where the VMM does not answer in time.
//!
//! Everything a VMM says is its guest's word, for a VMM its guest took
//! over: the answer is bounded in size and time by the API client, its
//! device names are never used, and its numbers are summed saturating.
//! A lie moves only that VM's own figures.

use std::collections::HashMap;
use std::fs;
use std::time::Duration;

use super::CloudHypervisor;
use super::process::{ProcStat, Tracked};
use crate::model::Id;
use crate::provision::{DiskCounts, Meters, NetCounts, NetSource, Reading};

/// How long a VMM has to answer `vm.counters`.
const COUNTERS_WAIT: Duration = Duration::from_millis(500);

impl Meters for CloudHypervisor {
    fn read(&self, vm_id: &Id) -> Option<Reading> {
        let tracked = Tracked::read(&self.store.layout().pidfile(vm_id))?;
        let stat = ProcStat::read(tracked.pid)?;
        if stat.start != tracked.start || matches!(stat.state, 'Z' | 'X') {
            return None;
        }
        let cgroup_cpu = self
            .confined
            .cgroups
            .as_ref()
            .ok()
            .and_then(|c| c.cpu_usage_ns(vm_id));
        let (disk, vmm_net) = self.counters(vm_id).unwrap_or_default();
        let (net, net_from) = match vmm_net {
            Some(net) => (Some(net), NetSource::Vmm),
            None => (self.tap_counts(vm_id), NetSource::Taps),
        };
        let (cpu_ns, resident_bytes) = cpu_and_memory(&stat, clock_ticks(), page_size());
        Some(Reading {
            pid: u32::try_from(tracked.pid).ok()?,
            started: tracked.start,
            cpu_ns: cgroup_cpu.or(cpu_ns),
            resident_bytes,
            disk,
            net,
            net_from,
        })
    }
}

impl CloudHypervisor {
    /// The VMM's own counts of its disks and NICs; `None` when it did not
    /// answer `vm.counters` with them in time.
    fn counters(&self, vm_id: &Id) -> Option<(Option<DiskCounts>, Option<NetCounts>)> {
        let (status, body) = crate::provision::unix_http::request(
            &self.socket_path(vm_id),
            "GET",
            "/api/v1/vm.counters",
            None,
            COUNTERS_WAIT,
        )
        .ok()?;
        if status != 200 {
            return None;
        }
        parse_counters(&body)
    }

    /// What the host kernel counted on the VM's taps, turned to the
    /// guest's side (what a tap sends goes in to the guest). Read from
    /// `/proc/thread-self/net/dev`, which is this thread's network namespace's
    /// (sysfs shows the one it was mounted in); only when the VMM did not
    /// answer, so its length (a row per link) is paid rarely.
    fn tap_counts(&self, vm_id: &Id) -> Option<NetCounts> {
        let taps = self.taps(vm_id)?;
        let table = fs::read_to_string("/proc/thread-self/net/dev").ok()?;
        tap_rows(&table, &[&taps.underlay, &taps.site])
    }
}

/// The named links' bytes in a `/proc/net/dev` table, summed and turned to
/// the guest's side; `None` when none is there.
pub(crate) fn tap_rows(table: &str, taps: &[&str]) -> Option<NetCounts> {
    let mut total: Option<NetCounts> = None;
    for line in table.lines() {
        let Some((name, row)) = line.split_once(':') else {
            continue;
        };
        if !taps.contains(&name.trim()) {
            continue;
        }
        // Eight receive columns, then the transmit ones.
        let fields: Vec<u64> = row
            .split_whitespace()
            .map_while(|f| f.parse().ok())
            .collect();
        if let (Some(&received), Some(&sent)) = (fields.first(), fields.get(8)) {
            let t = total.get_or_insert_with(NetCounts::default);
            t.rx_bytes = t.rx_bytes.saturating_add(sent);
            t.tx_bytes = t.tx_bytes.saturating_add(received);
        }
    }
    total
}

/// `vm.counters`' answer (a map of device to its counters), summed into
/// disks (devices that count `read_bytes`) and NICs (`rx_bytes`); `None`
/// when it is no such map.
pub(crate) fn parse_counters(body: &[u8]) -> Option<(Option<DiskCounts>, Option<NetCounts>)> {
    let devices: HashMap<String, Device> = serde_json::from_slice(body).ok()?;
    let (mut disk, mut net): (Option<DiskCounts>, Option<NetCounts>) = (None, None);
    for counters in devices.values() {
        if let Some(read_bytes) = counters.read_bytes {
            let d = disk.get_or_insert_with(DiskCounts::default);
            d.read_bytes = d.read_bytes.saturating_add(read_bytes);
            d.write_bytes = d
                .write_bytes
                .saturating_add(counters.write_bytes.unwrap_or(0));
            d.read_ops = d.read_ops.saturating_add(counters.read_ops.unwrap_or(0));
            d.write_ops = d.write_ops.saturating_add(counters.write_ops.unwrap_or(0));
        } else if let Some(rx_bytes) = counters.rx_bytes {
            let n = net.get_or_insert_with(NetCounts::default);
            n.rx_bytes = n.rx_bytes.saturating_add(rx_bytes);
            n.tx_bytes = n.tx_bytes.saturating_add(counters.tx_bytes.unwrap_or(0));
        }
    }
    Some((disk, net))
}

/// The counters of one device that are summed (the rest, latencies and
/// frames, are passed over).
#[derive(serde::Deserialize)]
struct Device {
    read_bytes: Option<u64>,
    write_bytes: Option<u64>,
    read_ops: Option<u64>,
    write_ops: Option<u64>,
    rx_bytes: Option<u64>,
    tx_bytes: Option<u64>,
}

/// A stat line's CPU time and resident memory in nanoseconds and bytes,
/// in a kernel's clock ticks per second and page size.
fn cpu_and_memory(
    stat: &ProcStat,
    hz: Option<u64>,
    page: Option<u64>,
) -> (Option<u64>, Option<u64>) {
    (
        hz.and_then(|hz| stat.cpu_ticks.checked_mul(1_000_000_000).map(|n| n / hz)),
        page.and_then(|page| stat.resident_pages.checked_mul(page)),
    )
}

fn clock_ticks() -> Option<u64> {
    positive(nix::unistd::SysconfVar::CLK_TCK)
}

fn page_size() -> Option<u64> {
    positive(nix::unistd::SysconfVar::PAGE_SIZE)
}

/// A `sysconf` value the kernel gives as a positive number.
fn positive(name: nix::unistd::SysconfVar) -> Option<u64> {
    nix::unistd::sysconf(name)
        .ok()
        .flatten()
        .and_then(|n| u64::try_from(n).ok())
        .filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_summed_into_disks_and_nics_by_what_each_counts() {
        let body = br#"{
            "_disk0": {"read_bytes": 1000, "write_bytes": 10, "read_ops": 4, "write_ops": 1, "read_latency_avg": 7},
            "_disk1": {"read_bytes": 24, "write_bytes": 0, "read_ops": 1, "write_ops": 0},
            "_net2": {"rx_bytes": 300, "rx_frames": 3, "tx_bytes": 50, "tx_frames": 1},
            "_rng": {}
        }"#;

        let (disk, net) = parse_counters(body).expect("a map of devices");

        assert_eq!(
            disk,
            Some(DiskCounts {
                read_bytes: 1024,
                write_bytes: 10,
                read_ops: 5,
                write_ops: 1
            })
        );
        assert_eq!(
            net,
            Some(NetCounts {
                rx_bytes: 300,
                tx_bytes: 50
            })
        );
    }

    #[test]
    fn counters_a_vmm_inflates_saturate_rather_than_wrap() {
        let body = format!(
            r#"{{"a": {{"read_bytes": {max}}}, "b": {{"read_bytes": {max}}}}}"#,
            max = u64::MAX
        );

        let (disk, _) = parse_counters(body.as_bytes()).expect("a map of devices");

        assert_eq!(disk.map(|d| d.read_bytes), Some(u64::MAX));
    }

    #[test]
    fn a_taps_counts_are_turned_to_the_guests_side() {
        let table = "Inter-|   Receive                            |  Transmit\n \
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n \
    lo:     100       1    0    0    0     0          0         0      100       1    0    0    0     0       0          0\n \
ec1a2:    5000      10    0    0    0     0          0         0    70000      50    0    0    0     0       0          0\n";

        let counts = tap_rows(table, &["ec1a2", "ec1a2s"]);

        // The tap took 5000 bytes from its VMM (the guest sent them) and
        // handed it 70000 (the guest took them in).
        assert_eq!(
            counts,
            Some(NetCounts {
                rx_bytes: 70000,
                tx_bytes: 5000
            })
        );
    }

    #[test]
    fn an_answer_that_is_no_map_of_devices_is_no_counts() {
        assert_eq!(parse_counters(b"[\"Error from API\"]"), None);
    }

    #[test]
    fn a_stat_line_gives_cpu_time_and_resident_memory_whatever_the_command() {
        // A command with a space and a parenthesis; utime 250, stime 50,
        // start 9000, rss 1024 pages.
        let text = "4242 (cloud hyp) er) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 8 0 9000 100000000 1024 18446744073709551615";

        let stat = ProcStat::parse(text).expect("a stat line");
        let (cpu_ns, resident_bytes) = cpu_and_memory(&stat, Some(100), Some(4096));

        assert_eq!((stat.state, stat.start), ('S', 9000));
        assert_eq!(cpu_ns, Some(3_000_000_000));
        assert_eq!(resident_bytes, Some(4 * 1024 * 1024));
    }
}
