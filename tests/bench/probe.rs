//! `make bench-probe`: what a console readiness probe costs the agent on a
//! guest that printed 8 MiB and never the probe's text, from outside: the
//! agent binary runs as an operator runs it (a desired file, the stand-in
//! hypervisor), and its own CPU time (`/proc/PID/stat`, user + system) is
//! read over `SECONDS` probe periods, once with the probe and once without
//! (the agent's floor: its ticks). Beside it, the yardstick: one read and
//! search of the whole 8 MiB in this process, which is what a probe that
//! rereads the console costs every period.
//!
//! `EITRI_BENCH_AGENT=PATH` times another build of the agent, so two builds
//! can be compared in turns on one machine.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error>;

/// How much the guest printed.
const CONSOLE: usize = 8 << 20;
/// Probe periods measured, each 1 s.
const SECONDS: u64 = 20;
/// A bound to fail on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(20);

struct Agent {
    child: Child,
    dir: PathBuf,
    cgroup_root: String,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Agent {
    /// Starts the agent with one VM, probed for a line no guest prints or
    /// not probed, and waits for its hypervisor.
    fn start(dir: &Path, probed: bool) -> Result<Agent, Error> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir)?;
        // Searchable by the jailed hypervisor, which reaches its files by name.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
        let kernel = dir.join("vmlinux");
        std::fs::write(&kernel, b"kernel")?;
        let image = dir.join("guest.raw");
        std::fs::write(&image, vec![0x5a; 1 << 20])?;
        let sha = eitri_agent::image::sha256_file(&image)?;
        let readiness = if probed {
            r#","readiness":{"serial_contains":"never-printed-marker","period_s":1,"grace_s":3600}"#
        } else {
            ""
        };
        std::fs::write(
            dir.join("desired.json"),
            format!(
                r#"{{"vms":[{{"vm_id":"p-1","name":"p-1","image_url":"file://{}","image_sha256":"{sha}","vcpus":1,"mem_mb":64,"disk_gb":1,"power_state":"running"{readiness}}}]}}"#,
                image.display()
            ),
        )?;
        let confinement = eitri_agent::testkit::confinement(dir);
        let cgroup_root = format!("{}-probe{}", confinement.cgroup_root, u8::from(probed));
        let binary = std::env::var_os("EITRI_BENCH_AGENT").map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_eitri-agent")),
            PathBuf::from,
        );
        let path = |p: &Path| p.display().to_string();
        let (first, count) = eitri_agent::testkit::test_vmm_ids();
        let child = Command::new(binary)
            .args(["run", "--state-dir", &path(&dir.join("state"))])
            .args(["--desired", &path(&dir.join("desired.json"))])
            .args([
                "--hypervisor",
                env!("CARGO_BIN_EXE_eitri-standin-hypervisor"),
            ])
            .args(["--kernel", &path(&kernel), "--image-root", &path(dir)])
            .args(["--kvm-device", &path(&confinement.kvm)])
            .arg("--userfaultfd-device=")
            .args(["--cgroup-root", &cgroup_root])
            .args(["--vmm-ids", &format!("{first}:{count}")])
            .args(["--agents-dir", &path(&dir.join("agents"))])
            .args(["--run-dir", &path(&dir.join("run"))])
            .args(["--underlay-bridge=", "--tick", "1s"])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("agent.log"))?)
            .spawn()?;
        let agent = Agent {
            child,
            dir: dir.to_path_buf(),
            cgroup_root,
        };
        let since = Instant::now();
        while !std::fs::read_to_string(dir.join("agent.log"))?.contains("hypervisor started") {
            if since.elapsed() > PATIENCE {
                return Err(format!("no hypervisor in {PATIENCE:?}; see {}", dir.display()).into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(agent)
    }

    fn serial_log(&self) -> PathBuf {
        self.dir.join("state/vms/p-1/serial.log")
    }

    /// Its CPU time so far (user + system).
    fn cpu(&self) -> Result<Duration, Error> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100) as u64;
        Ok(Duration::from_millis(ticks * 1000 / hz))
    }
}

/// The guest's 8 MiB: lines that never hold the probe's text.
fn console() -> Vec<u8> {
    let line = b"a console line of the guest that is not the marker, 64 bytes lo\n";
    line.iter().copied().cycle().take(CONSOLE).collect()
}

/// The agent's CPU a second over `SECONDS`, once the guest printed 8 MiB.
fn cpu_per_period(probed: bool) -> Result<Duration, Error> {
    let dir =
        std::env::temp_dir().join(format!("eitri-bench-probe-{}-{probed}", std::process::id()));
    let agent = Agent::start(&dir, probed)?;
    std::fs::OpenOptions::new()
        .append(true)
        .open(agent.serial_log())
        .and_then(|mut f| std::io::Write::write_all(&mut f, &console()))?;
    // The first look after the burst reads it once; then periods alone.
    std::thread::sleep(Duration::from_secs(3));
    let before = agent.cpu()?;
    std::thread::sleep(Duration::from_secs(SECONDS));
    let spent = agent.cpu()?.saturating_sub(before);
    Ok(spent / SECONDS as u32)
}

/// One read and search of the whole console: what a probe that rereads
/// it spends every period.
fn full_scan() -> Result<Duration, Error> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("serial.log");
    std::fs::write(&path, console())?;
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let started = Instant::now();
        let bytes = std::fs::read(&path)?;
        let found = bytes
            .split(|b| *b == b'\n')
            .any(|l| l.windows(20).any(|w| w == b"never-printed-marker"));
        best = best.min(started.elapsed());
        assert!(!found);
    }
    Ok(best)
}

fn main() -> Result<(), Error> {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let probed = cpu_per_period(true)?;
    let floor = cpu_per_period(false)?;
    let scan = full_scan()?;
    let probe = probed.saturating_sub(floor);
    println!(
        "bench=probe console_mib={} agent_cpu_ms_per_period={:.1} without_probe={:.1} probe_ms={:.1} full_scan_ms={:.1} full_scan_over_probe={:.1}",
        CONSOLE >> 20,
        ms(probed),
        ms(floor),
        ms(probe),
        ms(scan),
        // At the clock tick's resolution a probe can read as 0: then the
        // ratio is against half a tick.
        ms(scan) / ms(probe).max(0.5),
    );
    Ok(())
}
