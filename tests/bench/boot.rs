//! `make bench-boot`: the agent's own overhead on a boot.
//!
//! For 50 boots of the stand-in hypervisor: the time from `boot` called to
//! `boot` returned, minus the stand-in's own time from `main` to a socket
//! that accepts (it logs both instants). What remains is the agent's work:
//! tap, fork and exec (counted against the agent, conservatively), pidfile,
//! reaper, and the API polls until `vm.info` says Running.

use std::sync::Arc;
use std::time::{Duration, Instant};

use eitri_agent::deadline::Deadline;
use eitri_agent::model::Id;
use eitri_agent::provision::HypervisorSettings;
use eitri_agent::provision::Lifecycle;
use eitri_agent::provision::cloudhv::{CloudHvConfig, CloudHypervisor};
use eitri_agent::state::Store;
use eitri_agent::testkit::desired;

const BOOTS: usize = 50;

fn standin_time(log: &std::path::Path) -> Option<Duration> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().rev().find(|l| l.contains("standin-timing"))?;
    let field = |key: &str| -> Option<u128> {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))?
            .parse()
            .ok()
    };
    let (main, ready) = (field("main_ns=")?, field("ready_ns=")?);
    Some(Duration::from_nanos(ready.checked_sub(main)? as u64))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    eitri_agent::testkit::remove_on_signal(dir.path());
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, b"kernel")?;
    let store = Arc::new(Store::open(&dir.path().join("state"))?);
    let backend = CloudHypervisor::new(
        Arc::clone(&store),
        CloudHvConfig {
            hypervisor: Arc::new(HypervisorSettings::new(
                env!("CARGO_BIN_EXE_eitri-standin-hypervisor").into(),
                Some(kernel),
                dir.path().join("run"),
            )),
            tap_prefix: format!("eb{:04x}", std::process::id() & 0xffff),
            boot_wait: Duration::from_secs(10),
            network: None,
            confinement: Arc::new(eitri_agent::testkit::confinement(dir.path())),
            limits: Arc::default(),
        },
    );
    let spec = desired("bench-vm").spec;
    let vm = Id::parse("bench-vm")?;
    let mut overheads = Vec::with_capacity(BOOTS);
    let mut totals = Vec::with_capacity(BOOTS);
    for _ in 0..BOOTS {
        let _ = std::fs::remove_file(store.layout().hypervisor_log(&vm));
        let start = Instant::now();
        backend
            .boot(&spec, Deadline::NONE)
            .map_err(|e| e.to_string())?;
        let total = start.elapsed();
        let own = standin_time(&store.layout().hypervisor_log(&vm))
            .ok_or("the stand-in logged no timing")?;
        overheads.push(total.saturating_sub(own));
        totals.push(total);
        backend
            .destroy(&vm, Deadline::NONE)
            .map_err(|e| e.to_string())?;
    }
    overheads.sort();
    totals.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let pct = |v: &[Duration], p: f64| ms(v[((v.len() - 1) as f64 * p).round() as usize]);

    println!(
        "boot: total p50 {:.2} ms; the agent's share p50 {:.2} ms, p99 {:.2} ms",
        pct(&totals, 0.5),
        pct(&overheads, 0.5),
        pct(&overheads, 0.99)
    );
    println!(
        "bench=boot boots={BOOTS} overhead_ms_p50={:.2} overhead_ms_p99={:.2} total_ms_p50={:.2}",
        pct(&overheads, 0.5),
        pct(&overheads, 0.99),
        pct(&totals, 0.5)
    );
    eitri_agent::testkit::remove_cgroup_root(
        &eitri_agent::testkit::confinement(dir.path()).cgroup_root,
    );
    Ok(())
}
