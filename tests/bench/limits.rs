//! `make bench-limits`: a limit's measured rate over its set rate, with
//! the unlimited rate beside it in the same run.
//!
//! - CPU cap (the host holds it: the VM's cgroup quota): the stand-in
//!   hypervisor with one vCPU thread that never idles, booted by the
//!   cloud-hypervisor backend jailed as on a host, its CPU time read from
//!   /proc over a window; capped at `CAP_MILLIS`, then with no cap.
//! - Disk and NIC limits are held by the VMM (its rate limiters), so only a
//!   real cloud-hypervisor with a guest that moves bytes can show their
//!   rates; the tiny guest does no I/O, so they are not measured here.
//!
//! Run as root.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use eitri_agent::deadline::Deadline;
use eitri_agent::model::VmLimits;
use eitri_agent::provision::Provisioner;
use eitri_agent::provision::cloudhv::{CloudHvConfig, CloudHypervisor};
use eitri_agent::provision::supervise::StopTimeouts;
use eitri_agent::state::Store;
use eitri_agent::testkit::{desired, id};

const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// The cap measured: half a CPU.
const CAP_MILLIS: u32 = 500;
/// How long a rate is measured over, after a settling second.
const WINDOW: Duration = Duration::from_secs(4);

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )?;
    let hypervisor = dir.path().join("burner");
    eitri_agent::testkit::standin_hypervisor(
        Path::new(STANDIN),
        &hypervisor,
        &[("STANDIN_BURN_CPUS", "1")],
    );
    let backend = backend(dir.path(), hypervisor)?;
    let capped = cpu_rate(&backend, "capped", CAP_MILLIS)?;
    let free = cpu_rate(&backend, "free", 0)?;
    let set = f64::from(CAP_MILLIS) / 1000.0;
    println!(
        "cpu: capped at {set} CPU, measured {capped:.3} CPU; with no cap {free:.3} CPU (one vCPU that never idles)"
    );
    println!(
        "disk, net: not measured: the VMM holds them, and the tiny guest moves no bytes; that a real cloud-hypervisor holds them is tested (tests/cloudhv.rs, a_real_vmm_holds_the_disk_and_nic_limits_it_was_given)"
    );
    println!(
        "bench=limits cpu_set={set:.3} cpu_measured={capped:.3} cpu_ratio={:.3} cpu_unlimited={free:.3}",
        capped / set
    );
    Ok(())
}

fn backend(dir: &Path, hypervisor: PathBuf) -> Result<CloudHypervisor, Error> {
    let kernel = dir.join("vmlinux");
    std::fs::write(&kernel, b"not really a kernel")?;
    let store = Arc::new(Store::open(&dir.join("state"))?);
    let cfg = CloudHvConfig {
        hypervisor,
        kernel: Some(kernel),
        firmware: None,
        cmdline: "console=ttyS0".into(),
        run_dir: dir.join("run"),
        tap_prefix: format!("el{:04x}", std::process::id() & 0xffff),
        boot_wait: Duration::from_secs(10),
        network: None,
        stop: StopTimeouts::default(),
        confinement: eitri_agent::testkit::confinement(dir),
    };
    Ok(CloudHypervisor::new(store, cfg))
}

/// CPUs a VM of one never-idle vCPU uses, capped at `millis` (0: none).
fn cpu_rate(backend: &CloudHypervisor, vm: &str, millis: u32) -> Result<f64, Error> {
    let mut spec = desired(vm).spec;
    spec.limits = VmLimits {
        cpu_max_millis: millis,
        ..VmLimits::default()
    };
    backend
        .boot(&spec, Deadline::after(Duration::from_secs(10)))
        .map_err(|e| eitri_agent::error::chain(&*e))?;
    let pid = backend.pid(&id(vm)).ok_or("no VMM pid")?;
    std::thread::sleep(Duration::from_secs(1));
    let (start, used) = (Instant::now(), cpu_seconds(pid)?);
    std::thread::sleep(WINDOW);
    let rate = (cpu_seconds(pid)? - used) / start.elapsed().as_secs_f64();
    backend
        .destroy(&id(vm), Deadline::after(Duration::from_secs(10)))
        .map_err(|e| eitri_agent::error::chain(&*e))?;
    Ok(rate)
}

/// The process's CPU time so far, all its threads, user and system.
fn cpu_seconds(pid: u32) -> Result<f64, Error> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').ok_or("a stat line")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of the line, 12 and 13 after ')'.
    let ticks: u64 = fields.get(11).ok_or("utime")?.parse::<u64>()?
        + fields.get(12).ok_or("stime")?.parse::<u64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100);
    Ok(ticks as f64 / hz as f64)
}
