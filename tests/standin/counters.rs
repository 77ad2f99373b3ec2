//! What the stand-in answers `vm.counters` with, as cloud-hypervisor does:
//! a map of device id to its counters, each disk with its bytes, requests
//! and latencies, each NIC with its bytes and frames from the guest's side
//! (`rx`: what the guest took in). The first disk and the first NIC count
//! what really passed: the disk the reads `STANDIN_DISK_READ` makes, the
//! NIC what the guest behind `STANDIN_GUEST_TCP` took and sent; the rest
//! stay at 0.

use std::os::unix::fs::FileExt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub static DISK_READ_BYTES: AtomicU64 = AtomicU64::new(0);
pub static DISK_READ_OPS: AtomicU64 = AtomicU64::new(0);
pub static NET_RX_BYTES: AtomicU64 = AtomicU64::new(0);
pub static NET_RX_FRAMES: AtomicU64 = AtomicU64::new(0);
pub static NET_TX_BYTES: AtomicU64 = AtomicU64::new(0);
pub static NET_TX_FRAMES: AtomicU64 = AtomicU64::new(0);

/// One disk request's size.
const REQUEST: usize = 64 * 1024;

/// `GET vm.counters`: the status, the body, and no exit.
pub fn request(state: &Mutex<String>, config: &crate::Config) -> (u16, String, bool) {
    if crate::knob("STANDIN_COUNTERS_SILENT").is_some() {
        // Holds the request unanswered, as a VMM its guest took over
        // could: the caller's bound ends the wait.
        std::thread::sleep(Duration::from_secs(3600));
        return (500, String::new(), false);
    }
    if *state.lock().unwrap_or_else(|p| p.into_inner()) == "Deleted" {
        return (
            400,
            r#"["Error from API","VM is not created"]"#.to_owned(),
            false,
        );
    }
    (200, answer(&config.disk_ids(), &config.nets()), false)
}

/// The answer, for disks and NICs by their ids in the order the VM has
/// them.
fn answer(disks: &[String], nics: &[String]) -> String {
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let mut map = serde_json::Map::new();
    for (i, id) in disks.iter().enumerate() {
        let (bytes, ops) = if i == 0 {
            (load(&DISK_READ_BYTES), load(&DISK_READ_OPS))
        } else {
            (0, 0)
        };
        map.insert(
            id.clone(),
            serde_json::json!({
                "read_bytes": bytes, "read_ops": ops, "write_bytes": 0, "write_ops": 0,
                "read_latency_min": 0, "read_latency_max": 0, "read_latency_avg": 0,
                "write_latency_min": 0, "write_latency_max": 0, "write_latency_avg": 0,
            }),
        );
    }
    for (i, id) in nics.iter().enumerate() {
        let first = i == 0;
        let pick = |c: &AtomicU64| if first { load(c) } else { 0 };
        map.insert(
            id.clone(),
            serde_json::json!({
                "rx_bytes": pick(&NET_RX_BYTES), "rx_frames": pick(&NET_RX_FRAMES),
                "tx_bytes": pick(&NET_TX_BYTES), "tx_frames": pick(&NET_TX_FRAMES),
            }),
        );
    }
    serde_json::Value::Object(map).to_string()
}

/// A guest reading `path` at `per_second` bytes a second, in 64 KiB
/// requests from its start around, for ever (until the file fails).
pub fn read_disk(path: &str, per_second: u64) {
    let Ok(file) = std::fs::File::open(path) else {
        return;
    };
    let mut buf = vec![0u8; REQUEST];
    let started = Instant::now();
    let mut offset = 0u64;
    let mut done = 0u64;
    loop {
        let due = (started.elapsed().as_secs_f64() * per_second as f64) as u64;
        if done >= due {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        let n = match file.read_at(&mut buf, offset) {
            Ok(0) if offset == 0 => return,
            Ok(0) => {
                offset = 0;
                continue;
            }
            Ok(n) => n,
            Err(_) => return,
        };
        offset += n as u64;
        done += n as u64;
        DISK_READ_BYTES.fetch_add(n as u64, Ordering::Relaxed);
        DISK_READ_OPS.fetch_add(1, Ordering::Relaxed);
    }
}
