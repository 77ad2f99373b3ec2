//! `make bench-suspend`: suspending and resuming a VM through the whole
//! agent (engine, records, the cloud-hypervisor backend, its jail, the host
//! network on in a private namespace), each against what stands beside it
//! in the same run. Run as root.
//!
//! - With the stand-in: `ROUNDS` suspends and resumes of one VM, and as
//!   many cold boots (stopped, then started) of it.
//! - With `EITRI_REAL_CH` naming a cloud-hypervisor: the same at 64 MiB
//!   and at 1 GiB, on a guest this bench writes (`touching_guest`: a PVH
//!   ELF that writes every page of its memory above 2 MiB, then prints
//!   `TOUCHED`), so a snapshot holds what a busy guest's would. Beside
//!   them: a bare restore of the same snapshot by hand (a copy of it, its
//!   config pointed at copies of the disks, started as root with
//!   `--restore …,memory_restore_mode=ondemand,resume=true` on a tap of its
//!   own), and a plain sequential write of as many bytes as the snapshot
//!   holds, fsynced, as the yardstick of a suspend.
//!
//! Each figure is from the desired state's change to the row saying it
//! (the agent says Running once the VMM's API does). The last line:
//! `bench=suspend … suspend_ms_p50 resume_ms_p50 cold_boot_ms_p50
//! snapshot_mb …` per configuration, the real ones with `bare_restore_ms_p50`,
//! `resume_over_bare_ms` and `suspend_over_write`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use eitri_agent::deadline::Deadline;
use eitri_agent::model::{Id, Phase, PowerState, Snapshot};
use eitri_agent::provision::cloudhv::CloudHypervisor;
use eitri_agent::reconcile::{Engine, EngineConfig};
use eitri_agent::state::Store;
use eitri_agent::testkit::{desired, present, snapshot};

#[path = "agent.rs"]
mod agent;
#[path = "figures.rs"]
mod figures;
use figures::{ms, percentile, print_stages};

const ROUNDS: usize = 10;
const STANDIN: &str = env!("CARGO_BIN_EXE_eitri-standin-hypervisor");
/// A bound to give up on, not a measurement.
const PATIENCE: Duration = Duration::from_secs(120);
const VM: &str = "nap";

type Error = Box<dyn std::error::Error>;
type Traces = Arc<parking_lot::Mutex<Vec<eitri_agent::stages::Stages>>>;

struct Bench {
    /// The stages of every suspend and resume, as the agent times them.
    suspends: Traces,
    resumes: Traces,
    dir: tempfile::TempDir,
    store: Arc<Store>,
    engine: Engine,
    base_url: String,
    base_sha: String,
    mem_mb: u64,
    epoch: u64,
    cgroup_root: String,
    /// What the guest prints once its memory is all written.
    marker: &'static str,
}

impl Drop for Bench {
    fn drop(&mut self) {
        eitri_agent::testkit::end_cgroup_root(&self.cgroup_root);
    }
}

impl Bench {
    /// Against a real hypervisor and guest when given, else the stand-in.
    fn new(real: Option<(&Path, &Path)>, mem_mb: u64) -> Result<Bench, Error> {
        let dir = tempfile::tempdir()?;
        eitri_agent::testkit::remove_on_signal(dir.path());
        let (hypervisor, kernel, marker) = match real {
            Some((ch, guest)) => (ch.to_path_buf(), guest.to_path_buf(), "TOUCHED"),
            None => {
                let kernel = dir.path().join("vmlinux");
                std::fs::write(&kernel, b"not really a kernel")?;
                (PathBuf::from(STANDIN), kernel, "booting")
            }
        };
        let (base_url, base_sha) = agent::base_image(dir.path())?;
        let store = Arc::new(Store::open(&dir.path().join("state"))?);
        let prefix = format!("es{:04x}", std::process::id() & 0xffff);
        let cfg = agent::host_config(
            dir.path(),
            &store,
            (hypervisor, kernel),
            &prefix,
            real.is_some(),
        )?;
        let cgroup_root = cfg.confinement.cgroup_root.clone();
        let seams = agent::seams(
            &store,
            Arc::new(CloudHypervisor::new(Arc::clone(&store), cfg)),
            dir.path(),
        );
        let engine = Engine::new(
            Arc::clone(&store),
            seams,
            EngineConfig {
                agent_version: "1.0.0".into(),
                vm_timeout: Some(PATIENCE),
                ..EngineConfig::default()
            },
        );
        let (suspends, resumes) = (Traces::default(), Traces::default());
        {
            let (suspends, resumes) = (Arc::clone(&suspends), Arc::clone(&resumes));
            engine.watch_stages(move |_, stages| {
                let has = |stage: &str| stages.marks.iter().any(|m| m.stage == stage);
                if has("suspend") {
                    suspends.lock().push(stages.clone());
                }
                if has("resume") {
                    resumes.lock().push(stages.clone());
                }
            });
        }
        Ok(Bench {
            suspends,
            resumes,
            base_url,
            dir,
            store,
            engine,
            base_sha,
            mem_mb,
            epoch: 0,
            cgroup_root,
            marker,
        })
    }

    fn wanted(&mut self, power: PowerState) -> Snapshot {
        let mut d = desired(VM);
        d.spec.image_url = self.base_url.clone();
        d.spec.image_sha256 = self.base_sha.clone();
        d.spec.mem_mb = self.mem_mb;
        d.power = power;
        self.epoch += 1;
        snapshot(self.epoch, vec![present(d)])
    }

    /// Steps to `power` and waits until the row says it; how long that took.
    fn to(&mut self, power: PowerState) -> Result<Duration, Error> {
        let snap = self.wanted(power);
        let started = Instant::now();
        self.engine.step(&snap);
        let deadline = Deadline::after(PATIENCE);
        loop {
            let row = self
                .engine
                .published()
                .vms
                .iter()
                .find(|r| r.vm_id == VM)
                .map(|r| (r.power, r.phase, r.last_error.clone()));
            match row {
                Some((Some(p), Some(Phase::Ready), _)) if p == power => {
                    let took = started.elapsed();
                    self.engine.wait_idle(Deadline::after(PATIENCE));
                    return Ok(took);
                }
                Some((_, Some(Phase::Failed), why)) => {
                    return Err(format!("the VM failed on its way to {power:?}: {why}").into());
                }
                _ if deadline.expired() => return Err(format!("no {power:?} in time").into()),
                _ => {
                    let _ = self
                        .engine
                        .changes()
                        .recv_timeout(Duration::from_millis(50));
                }
            }
        }
    }

    /// Waits until the guest has printed its marker since the console's
    /// last truncation: its memory is written.
    fn settled(&self) -> Result<(), Error> {
        let serial = self.store.layout().serial_log(&id());
        let deadline = Deadline::after(PATIENCE);
        while !std::fs::read_to_string(&serial).is_ok_and(|t| t.contains(self.marker)) {
            if deadline.expired() {
                return Err("the guest never said it had written its memory".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// A resumed guest runs at once, and its VMM reads the rest of its
    /// snapshot in behind it (about 1.3 s a GiB here); a guest is not
    /// suspended again before that is done (it could not be saved until
    /// then), so that a suspend times a suspend.
    fn after_resume(&self) {
        std::thread::sleep(Duration::from_millis(200 + 3 * self.mem_mb));
    }

    /// What the committed snapshot holds of the disk.
    fn snapshot_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::read_dir(self.store.layout().snapshot(&id()))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }
}

fn id() -> Id {
    eitri_agent::testkit::id(VM)
}

fn p50(v: Vec<f64>) -> f64 {
    percentile(v, 0.5)
}

/// What one configuration measured.
#[derive(Default)]
struct Figures {
    suspend: Vec<f64>,
    resume: Vec<f64>,
    cold_boot: Vec<f64>,
    bare: Vec<f64>,
    write: Vec<f64>,
    snapshot_bytes: u64,
}

/// `ROUNDS` suspends and resumes, each resume beside a bare restore of
/// the same snapshot (real hypervisors), then `ROUNDS` cold boots.
fn measure(bench: &mut Bench, bare: Option<&Path>) -> Result<Figures, Error> {
    let mut f = Figures::default();
    bench.to(PowerState::Running)?;
    bench.settled()?;
    for round in 0..ROUNDS {
        if round > 0 {
            bench.after_resume();
        }
        f.suspend.push(ms(bench.to(PowerState::Suspended)?));
        f.snapshot_bytes = bench.snapshot_bytes();
        f.write
            .push(ms(plain_write(bench.dir.path(), f.snapshot_bytes)?));
        if let Some(ch) = bare {
            f.bare.push(ms(bare_restore(bench, ch, round)?));
        }
        f.resume.push(ms(bench.to(PowerState::Running)?));
    }
    for _ in 0..ROUNDS {
        bench.to(PowerState::Stopped)?;
        f.cold_boot.push(ms(bench.to(PowerState::Running)?));
    }
    bench.to(PowerState::Stopped)?;
    Ok(f)
}

/// Writes `bytes` (at least a page) sequentially to a new file and syncs
/// it: the yardstick of a suspend, which writes and syncs as much.
fn plain_write(dir: &Path, bytes: u64) -> Result<Duration, Error> {
    use std::io::Write;
    let path = dir.join("plain-write");
    let chunk = vec![0x5au8; 1 << 20];
    let started = Instant::now();
    let mut file = std::fs::File::create(&path)?;
    let mut left = bytes.max(4096);
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    file.sync_all()?;
    let took = started.elapsed();
    std::fs::remove_file(path)?;
    Ok(took)
}

/// A bare restore of the VM's committed snapshot by hand: a copy of it,
/// its config pointed at copies of the VM's disks and a serial file of its
/// own (the VM's are left as they are), restored as root by `ch` on a tap
/// of its own, resumed; the time from its start to its API saying
/// Running. It is killed after.
fn bare_restore(bench: &Bench, ch: &Path, round: usize) -> Result<Duration, Error> {
    use eitri_agent::provision::jail::fork;
    use std::os::fd::OwnedFd;
    let layout = bench.store.layout();
    let work = bench.dir.path().join(format!("bare-{round}"));
    let snap = work.join("snapshot");
    std::fs::create_dir_all(&snap)?;
    for entry in std::fs::read_dir(layout.snapshot(&id()))? {
        let entry = entry?;
        let copied = std::process::Command::new("cp")
            .arg("--sparse=always")
            .arg(entry.path())
            .arg(snap.join(entry.file_name()))
            .status()?;
        if !copied.success() {
            return Err("cp failed".into());
        }
    }
    let config_path = snap.join("config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&config_path)?)?;
    if let Some(disks) = config.get_mut("disks").and_then(|d| d.as_array_mut()) {
        for (i, disk) in disks.iter_mut().enumerate() {
            let from = disk["path"].as_str().unwrap_or_default().to_owned();
            let to = work.join(format!("disk-{i}"));
            std::process::Command::new("cp")
                .arg("--sparse=always")
                .arg(&from)
                .arg(&to)
                .status()?;
            disk["path"] = to.display().to_string().into();
        }
    }
    config["serial"]["file"] = work.join("serial.log").display().to_string().into();
    let rules = work.join("snapshot.tmp");
    std::fs::create_dir_all(&rules)?;
    if let Some(rules_list) = config
        .get_mut("landlock_rules")
        .and_then(|r| r.as_array_mut())
    {
        for rule in rules_list {
            rule["path"] = rules.display().to_string().into();
        }
    }
    std::fs::write(&config_path, serde_json::to_vec(&config)?)?;
    let socket = work.join("api.sock");
    let tap_name = format!("eb{:04x}{round:02}", std::process::id() & 0xffff);
    let tap = eitri_agent::provision::cloudhv::tap::open(&tap_name)?;
    let log = OwnedFd::from(std::fs::File::create(work.join("ch.log"))?);
    let args: Vec<std::ffi::OsString> = vec![
        "--api-socket".into(),
        format!("path={}", socket.display()).into(),
        "--restore".into(),
        format!(
            "source_url=file://{},memory_restore_mode=ondemand,net_fds=[net0@[3]],resume=true",
            snap.display()
        )
        .into(),
    ];
    let started = Instant::now();
    let pid = fork::start(
        &fork::Start {
            program: ch,
            args: &args,
            log: &log,
            own: &[&tap],
            cgroups: &[],
            netns: None,
            jail: None,
        },
        |_| Ok(()),
    )
    .map_err(|e| format!("the bare restore did not start: {e:?}"))?;
    let deadline = Deadline::after(PATIENCE);
    let running = loop {
        let state = eitri_agent::provision::unix_http::request(
            &socket,
            "GET",
            "/api/v1/vm.info",
            None,
            Duration::from_millis(500),
        )
        .ok()
        .and_then(|(status, body)| {
            let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
            (status == 200).then(|| v.get("state")?.as_str().map(str::to_owned))?
        });
        if state.as_deref() == Some("Running") {
            break Ok(started.elapsed());
        }
        if deadline.expired() {
            let said = std::fs::read_to_string(work.join("ch.log")).unwrap_or_default();
            break Err(format!("the bare restore never ran: {said}").into());
        }
        std::thread::sleep(Duration::from_micros(100));
    };
    let pid = nix::unistd::Pid::from_raw(pid);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    let _ = nix::sys::wait::waitpid(pid, None);
    drop(tap);
    let _ = std::fs::remove_dir_all(&work);
    running
}

/// A PVH ELF guest for cloud-hypervisor that writes one word into every
/// 4 KiB page of its memory from 2 MiB to `mem_mb` less 2 MiB, then prints
/// `TOUCHED` on COM1 and halts: a guest whose memory is all in use. The
/// layout is the tiny guest's (one PT_LOAD at 1 MiB, one Xen PHYS32_ENTRY
/// note); the code is 32-bit, flat, paging off, as PVH starts it.
fn touching_guest(path: &Path, mem_mb: u64) -> std::io::Result<()> {
    const LOAD: u64 = 0x10_0000;
    const CODE: usize = 0x100;
    let pages = u32::try_from((mem_mb.saturating_sub(4) << 20) / 4096)
        .unwrap_or(u32::MAX)
        .max(1);
    let mut code: Vec<u8> = Vec::new();
    code.extend([0xbf, 0x00, 0x00, 0x20, 0x00]); // mov edi, 0x200000
    code.push(0xb9); // mov ecx, pages
    code.extend(pages.to_le_bytes());
    // loop: mov dword [edi], 0x5a5a5a5a; add edi, 4096; dec ecx; jnz loop
    code.extend([0xc7, 0x07, 0x5a, 0x5a, 0x5a, 0x5a]);
    code.extend([0x81, 0xc7, 0x00, 0x10, 0x00, 0x00]);
    code.push(0x49);
    code.extend([0x75, 0xf1]);
    code.extend([0x66, 0xba, 0xf8, 0x03]); // mov dx, 0x3f8
    for byte in b"TOUCHED\n" {
        code.extend([0xb0, *byte, 0xee]); // mov al, byte; out dx, al
    }
    code.extend([0xf4, 0xeb, 0xfd]); // hlt; jmp hlt
    let entry = LOAD + CODE as u64;
    let note_off = 64 + 2 * 56;
    let mut elf = vec![0u8; CODE];
    elf.extend(&code);
    let len = elf.len() as u64;
    let put = |buf: &mut Vec<u8>, at: usize, bytes: &[u8]| {
        buf[at..at + bytes.len()].copy_from_slice(bytes)
    };
    put(&mut elf, 0, &[0x7f, b'E', b'L', b'F', 2, 1, 1]);
    put(&mut elf, 16, &2u16.to_le_bytes()); // ET_EXEC
    put(&mut elf, 18, &62u16.to_le_bytes()); // EM_X86_64
    put(&mut elf, 20, &1u32.to_le_bytes());
    put(&mut elf, 24, &entry.to_le_bytes());
    put(&mut elf, 32, &64u64.to_le_bytes()); // e_phoff
    put(&mut elf, 52, &64u16.to_le_bytes()); // e_ehsize
    put(&mut elf, 54, &56u16.to_le_bytes()); // e_phentsize
    put(&mut elf, 56, &2u16.to_le_bytes()); // e_phnum
    let header = |kind: u32, flags: u32, off: u64, size: u64, align: u64| {
        let mut h = Vec::with_capacity(56);
        h.extend(kind.to_le_bytes());
        h.extend(flags.to_le_bytes());
        h.extend(off.to_le_bytes());
        h.extend((LOAD + off).to_le_bytes());
        h.extend((LOAD + off).to_le_bytes());
        h.extend(size.to_le_bytes());
        h.extend(size.to_le_bytes());
        h.extend(align.to_le_bytes());
        h
    };
    put(&mut elf, 64, &header(1, 7, 0, len, 0x1000));
    put(&mut elf, 120, &header(4, 4, note_off as u64, 20, 4));
    let mut note = Vec::new();
    note.extend(4u32.to_le_bytes());
    note.extend(4u32.to_le_bytes());
    note.extend(18u32.to_le_bytes()); // XEN_ELFNOTE_PHYS32_ENTRY
    note.extend(b"Xen\0");
    note.extend((entry as u32).to_le_bytes());
    put(&mut elf, note_off, &note);
    std::fs::write(path, elf)
}

fn line(name: &str, f: &Figures, mem_mb: u64) -> String {
    let mut out = format!(
        " {name}_suspend_ms_p50={:.2} {name}_resume_ms_p50={:.2} {name}_cold_boot_ms_p50={:.2} {name}_snapshot_mb={:.2}",
        p50(f.suspend.clone()),
        p50(f.resume.clone()),
        p50(f.cold_boot.clone()),
        f.snapshot_bytes as f64 / (1 << 20) as f64,
    );
    if !f.bare.is_empty() {
        let touched_mb = mem_mb.saturating_sub(4) as f64;
        out.push_str(&format!(
            " {name}_bare_restore_ms_p50={:.2} {name}_resume_over_bare_ms={:.2} {name}_suspend_over_write={:.2} {name}_snapshot_over_touched={:.3}",
            p50(f.bare.clone()),
            p50(f.resume.clone()) - p50(f.bare.clone()),
            p50(f.suspend.clone()) / p50(f.write.clone()),
            f.snapshot_bytes as f64 / (1 << 20) as f64 / touched_mb,
        ));
    }
    out
}

fn main() -> Result<(), Error> {
    eitri_agent::testkit::net::private_network();
    let mut tail = String::new();
    {
        let mut bench = Bench::new(None, 256)?;
        let f = measure(&mut bench, None)?;
        print_stages("stand-in suspends", &bench.suspends.lock());
        println!(
            "stand-in: suspend p50 {:.2} ms, resume p50 {:.2} ms, cold boot p50 {:.2} ms",
            p50(f.suspend.clone()),
            p50(f.resume.clone()),
            p50(f.cold_boot.clone())
        );
        tail.push_str(&line("standin", &f, 256));
    }
    match std::env::var_os("EITRI_REAL_CH") {
        Some(ch) => {
            let ch = PathBuf::from(ch);
            for (name, mem_mb) in [("real64", 64u64), ("real1g", 1024)] {
                let dir = tempfile::tempdir()?;
                eitri_agent::testkit::remove_on_signal(dir.path());
                let guest = dir.path().join("touching.elf");
                touching_guest(&guest, mem_mb)?;
                let mut bench = Bench::new(Some((&ch, &guest)), mem_mb)?;
                let f = measure(&mut bench, Some(&ch))?;
                print_stages(&format!("{name} suspends"), &bench.suspends.lock());
                print_stages(&format!("{name} resumes"), &bench.resumes.lock());
                println!(
                    "{name}: suspend p50 {:.2} ms (a plain write of its {:.1} MB {:.2} ms), resume p50 {:.2} ms (bare restore {:.2} ms), cold boot p50 {:.2} ms",
                    p50(f.suspend.clone()),
                    f.snapshot_bytes as f64 / 1e6,
                    p50(f.write.clone()),
                    p50(f.resume.clone()),
                    p50(f.bare.clone()),
                    p50(f.cold_boot.clone())
                );
                tail.push_str(&line(name, &f, mem_mb));
            }
        }
        None => {
            println!("real: skipped (set EITRI_REAL_CH to a cloud-hypervisor binary to measure it)")
        }
    }
    println!("bench=suspend rounds={ROUNDS}{tail}");
    Ok(())
}
