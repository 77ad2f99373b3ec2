//! `make bench-repair`: how fast the agent acts, with the default 5 s tick,
//! on the two events that must not wait for it. The real binary in
//! standalone mode drives the stand-in hypervisor (no guest networking).
//!
//! - `desired_to_boot`: a VM added to the desired file (written by rename)
//!   to its hypervisor's first instruction (the stand-in logs its start).
//! - `kill_to_running`: `kill -9` of a VM's hypervisor to a `report.json`
//!   that says the VM runs again (written after the kill, by the agent's own
//!   clock), one kill per VM.
//!
//! The yardsticks, in the same run: the stand-in's own start-to-API time (a
//! repair cannot be faster than booting the hypervisor again), and how long
//! the kernel takes to reap a killed process that holds a tap (`tap_exit`):
//! the VMM's last fd on its tap unregisters the device, and the process is
//! not reaped, so not seen to exit, until that is done. The agent's own
//! share is what is left: `repair_overhead_ms_p50`.
//! Last line: `bench=repair tick_ms=5000 kill_to_running_ms_p50=…
//! kill_to_running_ms_p99=… desired_to_boot_ms_p50=… standin_boot_ms_p50=…
//! tap_exit_ms_p50=… repair_overhead_ms_p50=…`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const AGENT: &str = env!("CARGO_BIN_EXE_eitri-agent");
const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
const VMS: usize = 20;
const PATIENCE: Duration = Duration::from_secs(30);

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn wait<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> Res<T> {
    let until = Instant::now() + PATIENCE;
    loop {
        if let Some(v) = probe() {
            return Ok(v);
        }
        if Instant::now() > until {
            return Err(format!("timed out waiting for {what}").into());
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

struct Agent(Child);

/// The cgroup root every VMM of the bench runs under: ended (every
/// process in it killed, every cgroup removed) when the bench ends, ^C
/// included. The VMMs outlive their agent by design, so the agent's own
/// stop leaves them running.
struct Root(String);

impl Root {
    fn new() -> Root {
        let root = format!("eitri-test-{}", std::process::id());
        eitri_agent::testkit::end_when_signalled(root.clone());
        Root(root)
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        eitri_agent::testkit::end_cgroup_root(&self.0);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

struct Bench {
    dir: tempfile::TempDir,
    base_url: String,
    base_sha: String,
}

impl Bench {
    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn desired(&self, vms: usize) -> Res<()> {
        let entries: Vec<String> = (0..vms)
            .map(|i| {
                format!(
                    r#"{{"vm_id":"vm-{i}","name":"vm-{i}","image_url":"{}","image_sha256":"{}","vcpus":1,"mem_mb":64,"disk_gb":1,"power_state":"running"}}"#,
                    self.base_url, self.base_sha
                )
            })
            .collect();
        let temp = self.dir.path().join(".desired.tmp");
        std::fs::write(&temp, format!("{{\"vms\":[{}]}}", entries.join(",")))?;
        std::fs::rename(temp, self.dir.path().join("desired.json"))?;
        Ok(())
    }

    fn report(&self) -> Option<serde_json::Value> {
        let bytes = std::fs::read(self.state().join("report.json")).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    fn pid(&self, vm: &str) -> Option<i32> {
        let text =
            std::fs::read_to_string(self.state().join("vms").join(vm).join("hypervisor.pid"))
                .ok()?;
        text.split_whitespace().next()?.parse().ok()
    }

    /// The stand-in's (main, API ready) instants, from the newest start
    /// logged after `after_ns`.
    fn standin_start(&self, vm: &str, after_ns: u128) -> Option<(u128, u128)> {
        let log = self.state().join("vms").join(vm).join("hypervisor.log");
        let text = std::fs::read_to_string(log).ok()?;
        text.lines().rev().find_map(|l| {
            let field = |name: &str| -> Option<u128> {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(name))?
                    .parse()
                    .ok()
            };
            let (main, ready) = (field("main_ns=")?, field("ready_ns=")?);
            (main > after_ns).then_some((main, ready))
        })
    }
}

fn running_row(report: &serde_json::Value, vm: &str) -> bool {
    report["report"]["vms"].as_array().is_some_and(|rows| {
        rows.iter()
            .any(|r| r["vm_id"] == vm && r["power_state"] == "running" && r["status_detail"] == "")
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

fn start(b: &Bench, root: &Root) -> Res<Agent> {
    let kernel = b.dir.path().join("vmlinux");
    std::fs::write(&kernel, b"not really a kernel")?;
    let child = Command::new(AGENT)
        .args(["run", "--state-dir"])
        .arg(b.state())
        .arg("--desired")
        .arg(b.dir.path().join("desired.json"))
        .arg("--hypervisor")
        .arg(STANDIN)
        .arg("--kernel")
        .arg(&kernel)
        .arg("--run-dir")
        .arg(b.dir.path().join("run"))
        .arg("--image-root")
        .arg(b.dir.path().join("library"))
        .arg("--kvm-device")
        .arg(eitri_agent::testkit::confinement(b.dir.path()).kvm)
        .arg("--userfaultfd-device=")
        .args(["--underlay-bridge=", "--tap-prefix", "etrep"])
        .arg("--agents-dir")
        .arg(b.dir.path().join("agents"))
        .args(["--cgroup-root", &root.0])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(b.dir.path().join("agent.log"))?)
        .spawn()?;
    Ok(Agent(child))
}

/// Kill -9 to reaped, for a process holding a tap and nothing else.
fn tap_exit_ms(n: usize) -> Res<Vec<f64>> {
    let mut out = Vec::new();
    for i in 0..n {
        let tap = eitri_agent::provision::cloudhv::tap::open(&format!("etrpy{i}"))?;
        // dup drops close-on-exec: the child inherits the tap.
        let inherited = nix::unistd::dup(&tap)?;
        let mut child = Command::new("sleep").arg("60").spawn()?;
        drop((tap, inherited));
        std::thread::sleep(Duration::from_millis(20));
        let t = Instant::now();
        child.kill()?;
        child.wait()?;
        out.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(out)
}

fn main() -> Res<()> {
    let dir = tempfile::tempdir()?;
    eitri_agent::testkit::remove_on_signal(dir.path());
    std::fs::create_dir(dir.path().join("library"))?;
    let base = dir.path().join("library/base.raw");
    std::fs::write(&base, vec![0x5au8; 1 << 20])?;
    let base_sha = eitri_agent::image::sha256_file(&base)?;
    let b = Bench {
        base_url: format!("file://{}", base.display()),
        base_sha,
        dir,
    };
    b.desired(0)?;
    let root = Root::new();
    let _agent = start(&b, &root)?;
    wait("the first report", || b.report())?;

    let mut to_boot = Vec::new();
    let mut boots = Vec::new();
    for i in 0..VMS {
        let vm = format!("vm-{i}");
        let written = unix_ns();
        b.desired(i + 1)?;
        let (main, ready) = wait("the new VM's hypervisor", || b.standin_start(&vm, written))?;
        to_boot.push((main - written) as f64 / 1e6);
        boots.push((ready - main) as f64 / 1e6);
        wait("the new VM running", || {
            b.report().filter(|r| running_row(r, &vm))
        })?;
    }

    let mut to_running = Vec::new();
    for i in 0..VMS {
        let vm = format!("vm-{i}");
        let pid = wait("the pidfile", || b.pid(&vm))?;
        let killed_ms = (unix_ns() / 1_000_000) as u64;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        let written = wait("the repair in report.json", || {
            let report = b.report()?;
            let at = report["written_at_unix_ms"].as_u64()?;
            let fresh = at >= killed_ms && b.pid(&vm).is_some_and(|p| p != pid);
            (fresh && running_row(&report, &vm)).then_some(at)
        })?;
        to_running.push((written - killed_ms) as f64);
        if std::env::var_os("EITRI_BENCH_DEBUG").is_some() {
            println!("{vm}: killed {killed_ms} written {written}");
        }
    }

    let (to_boot, boots, to_running) = (sorted(to_boot), sorted(boots), sorted(to_running));
    let tap_exit = sorted(tap_exit_ms(VMS)?);
    let report = b.report().ok_or("no report")?;
    let tick_ms = report["tick_ms"].as_u64().unwrap_or(0);
    println!(
        "desired_to_boot_ms: p50 {:.2} p99 {:.2}; standin start-to-API ms: p50 {:.2}",
        percentile(&to_boot, 0.5),
        percentile(&to_boot, 0.99),
        percentile(&boots, 0.5)
    );
    let (p50, boot, tap) = (
        percentile(&to_running, 0.5),
        percentile(&boots, 0.5),
        percentile(&tap_exit, 0.5),
    );
    println!(
        "bench=repair tick_ms={tick_ms} kill_to_running_ms_p50={p50:.1} kill_to_running_ms_p99={:.1} desired_to_boot_ms_p50={:.2} standin_boot_ms_p50={boot:.2} tap_exit_ms_p50={tap:.1} repair_overhead_ms_p50={:.1}",
        percentile(&to_running, 0.99),
        percentile(&to_boot, 0.5),
        p50 - tap - boot,
    );
    if std::env::var_os("EITRI_BENCH_KEEP").is_some() {
        let kept = b.dir.keep();
        println!("kept {}", kept.display());
    }
    Ok(())
}
