//! A stand-in for cloud-hypervisor, for tests only (built with the
//! `standin` feature, never installed). It takes the real CLI, serves the
//! real API on the real socket, leaves the same files behind, and misbehaves
//! on request. What it imitates, observed of the real one (the README's
//! "The cloud-hypervisor backend"):
//!
//! - `--version` prints `cloud-hypervisor v53.0`.
//! - A live socket makes a second instance exit 1 ("already in use"); a
//!   stale one is replaced. `<socket>.lock` is created and stays.
//! - The API answers keep-alive with an empty reason phrase and never closes
//!   the connection itself.
//! - `vm.shutdown` keeps the process alive; `vmm.shutdown` answers 200,
//!   removes the socket and exits 0.
//! - The serial file is truncated at start and gets a boot line.
//! - `vm.snapshot {"destination_url":"file://DIR"}` (the VM paused, as
//!   v53 demands) writes `config.json` (what it was started with: serial
//!   file, disks, memory, NICs), `state.json` and `memory-ranges` (its
//!   memory's size, sparse: a few pages written) into DIR, which must
//!   exist; `--restore source_url=file://DIR,…,net_fds=[net0@[N],…],resume=true`
//!   reads them back: it truncates the serial file the config names and
//!   writes a resume line (no boot line), holds its new taps, and runs
//!   (or stays paused without `resume=true`). NICs in `net_fds` must be
//!   the config's. Each snapshot carries a nonce, logged at each restore
//!   (`standin-restored nonce=…`), so a snapshot restored twice shows.
//! - Flags are checked as v53 checks them: an unknown flag or disk option is
//!   an error (exit 2); a disk without `image_type` logs the deprecation of
//!   format probing; `image_type` and `backing_files` take only their
//!   values; `--landlock-rules` needs `--landlock`.
//!
//! Knobs, from the environment:
//! - `STANDIN_FAIL_START=msg`: log msg, exit 1 at once.
//! - `STANDIN_NO_SOCKET=1`: never open the socket.
//! - `STANDIN_CRASH_AFTER_MS=n`: after n ms log a KVM error and exit 1, as a
//!   VMM does when a vCPU hits an internal KVM error.
//! - `STANDIN_IGNORE_SHUTDOWN=1`: ignore power-button, vmm.shutdown and
//!   SIGTERM (only SIGKILL stops it).
//! - `STANDIN_SERIAL_FLOOD=n`: a guest printing n bytes a second to its
//!   serial port forever, numbered lines, as the real VMM writes them (one
//!   file opened once, its offset only growing).
//! - `STANDIN_SERIAL_PANIC=1`: the boot's console has a kernel panic's
//!   line, as a guest with a wrong root device prints it.
//! - `STANDIN_BURN_CPUS=n`: n threads spinning for ever, as a guest whose
//!   vCPUs never idle.
//! - `STANDIN_DISK_READ=n`: a guest reading its first disk at n bytes a
//!   second, counted in `vm.counters` (see `counters`), which it answers
//!   as the real one does.
//! - `STANDIN_COUNTERS_SILENT=1`: `vm.counters` is never answered.
//! - `STANDIN_LOG_FLOOD=n`: n bytes a second into its own log file, for
//!   ever, as a VMM its guest took over could write.
//! - `STANDIN_CONNECT=ip:port`: try a TCP connection there at start and
//!   log what came of it (`standin-connect ip:port reached|refused: why`).
//! - `STANDIN_LOOK=path,path`: log whether each path is there for it
//!   (`standin-look path there|absent`).
//! - `STANDIN_GROW=path`: try to grow that file to 1 TiB, and log what
//!   came of it (`standin-grow path grown|refused: why`).
//! - `STANDIN_FORK_CHILD=1`: start a `sleep` in a process group of its
//!   own and log its pid (`standin-child pid=N`): what a VMM taken over by
//!   its guest leaves behind.
//! - `STANDIN_FLOOD_ANSWERS=1`: answer every API request with a status
//!   line that never ends, as a VMM taken over by its guest could.
//! - `STANDIN_SNAPSHOT_FAIL=1`: `vm.snapshot` answers 500.
//! - `STANDIN_SNAPSHOT_EXTRA=name`: `vm.snapshot` also writes a file
//!   called `name`, as a VMM its guest took over could.
//! - `STANDIN_SNAPSHOT_FORGE=landlock-off|rule|disk|vcpus|/POINTER=JSON`:
//!   `vm.snapshot` writes a `config.json` that turns Landlock off, adds a
//!   rule for `/`, gives the VM a host disk or 64 vCPUs, or sets any field.
//! - `STANDIN_INFO_FORGE=…` (the same words): `vm.info` says so of the VM
//!   this VMM runs.
//! - `STANDIN_RESTORE_FAIL=1`: a restore logs an error and exits 1.
//! - `STANDIN_SNAPSHOT_BIG=1`: `vm.snapshot` writes a memory file twice
//!   the guest's memory.
//! - `STANDIN_SNAPSHOT_FLOOD=named|unnamed`: `vm.snapshot` goes on to fill
//!   its directory with 16 MiB files (up to 1 GiB), each left there or
//!   unlinked and held open, and logs how far it got
//!   (`standin-flood N MiB`): storage a VMM its guest took over could take.
//! - `STANDIN_SNAPSHOT_HOLD=1`: `vm.snapshot` keeps its memory file open
//!   for writing after it answers.
//! - `STANDIN_WRITE_INTO=dir`: try to create a file in that directory at
//!   start, and log what came of it (`standin-write dir written|refused:
//!   why`).
//! - `STANDIN_GUEST_TCP=1`: the guest answers ARP and TCP SYNs on its first
//!   NIC, and logs each SYN (see `wire`).
//! - `STANDIN_GUEST_AGENT=…`, `STANDIN_GUEST_UP_AFTER_MS=n`,
//!   `STANDIN_GUEST_STATUS_AFTER_MS=n`: how the guest
//!   agent behind `--vsock` answers (see `guest`). `--vsock
//!   cid=…,socket=PATH` binds PATH (failing where a file is left, as the
//!   real one does), is written into a snapshot's config and bound again
//!   at its restore; the guest's boot id is kept in the snapshot.

mod counters;
mod guest;
mod wire;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct Args {
    flags: HashMap<String, Vec<String>>,
}

impl Args {
    fn parse() -> Args {
        let mut flags: HashMap<String, Vec<String>> = HashMap::new();
        let mut current = String::new();
        for arg in std::env::args().skip(1) {
            if arg.starts_with('-') {
                current = arg.trim_start_matches('-').to_owned();
                flags.entry(current.clone()).or_default();
            } else {
                flags.entry(current.clone()).or_default().push(arg);
            }
        }
        Args { flags }
    }

    fn has(&self, flag: &str) -> bool {
        self.flags.contains_key(flag)
    }

    /// The `key=` value of a flag's first option list, e.g. path of
    /// `--api-socket path=/x`.
    fn option(&self, flag: &str, key: &str) -> Option<String> {
        self.flags.get(flag)?.iter().find_map(|v| {
            v.split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{key}=")).map(str::to_owned))
        })
    }
}

const FLAGS: &[&str] = &[
    "api-socket",
    "vsock",
    "kernel",
    "firmware",
    "cmdline",
    "initramfs",
    "disk",
    "net",
    "serial",
    "console",
    "cpus",
    "memory",
    "log-file",
    "v",
    "event-monitor",
    "landlock",
    "landlock-rules",
    "seccomp",
    "restore",
    "rate-limit-group",
];

const DISK_KEYS: &[&str] = &[
    "path",
    "readonly",
    "direct",
    "iommu",
    "num_queues",
    "queue_size",
    "vhost_user",
    "socket",
    "id",
    "pci_segment",
    "serial",
    "sparse",
    "image_type",
    "backing_files",
    "bw_size",
    "bw_one_time_burst",
    "bw_refill_time",
    "ops_size",
    "ops_one_time_burst",
    "ops_refill_time",
    "rate_limit_group",
];

/// The command line as v53 checks it; a deprecation is logged, not fatal.
fn check(args: &Args, log: &Log) -> Result<(), String> {
    for flag in args.flags.keys() {
        if !FLAGS.contains(&flag.as_str()) {
            return Err(format!("unexpected argument '--{flag}' found"));
        }
    }
    for disk in args.flags.get("disk").into_iter().flatten() {
        let mut typed = false;
        for kv in disk.split(',') {
            let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
            if !DISK_KEYS.contains(&key) {
                return Err(format!(
                    "invalid disk parameters: unknown option {key:?} in {disk:?}"
                ));
            }
            match key {
                "image_type" if !["raw", "qcow2", "vhd", "vhdx"].contains(&value) => {
                    return Err(format!("invalid disk parameters: image_type={value:?}"));
                }
                "backing_files" | "readonly" if !["on", "off"].contains(&value) => {
                    return Err(format!("invalid disk parameters: {key}={value:?}"));
                }
                "image_type" => typed = true,
                _ => {}
            }
        }
        if !typed {
            log.line(
                "DEPRECATION: auto-detection of disk image type is deprecated; set image_type. Autodetected raw image type. Disabling sector 0 writes.",
            );
        }
    }
    // As v53 validates rate limits: a disk in a group names one given by
    // --rate-limit-group, and has no bucket of its own besides.
    let groups: Vec<&str> = args
        .flags
        .get("rate-limit-group")
        .into_iter()
        .flatten()
        .filter_map(|g| g.split(',').find_map(|kv| kv.strip_prefix("id=")))
        .collect();
    for disk in args.flags.get("disk").into_iter().flatten() {
        let group = disk
            .split(',')
            .find_map(|kv| kv.strip_prefix("rate_limit_group="));
        if let Some(group) = group {
            if !groups.contains(&group) {
                return Err(format!(
                    "invalid disk parameters: rate limit group {group:?} is not defined"
                ));
            }
            if disk.contains("bw_size=") || disk.contains("ops_size=") {
                return Err(format!(
                    "invalid disk parameters: {disk:?} has a rate limit group and its own rate limiter"
                ));
            }
        }
    }
    if args.has("landlock-rules") && !args.has("landlock") {
        return Err("--landlock-rules needs --landlock".into());
    }
    for rule in args.flags.get("landlock-rules").into_iter().flatten() {
        let mut keys = rule
            .split(',')
            .map(|kv| kv.split_once('=').map_or(kv, |(k, _)| k));
        if !(keys.any(|k| k == "path") && rule.contains("access=")) {
            return Err(format!(
                "invalid landlock rule {rule:?}: needs path= and access="
            ));
        }
        let path = rule
            .split(',')
            .find_map(|kv| kv.strip_prefix("path="))
            .unwrap_or("");
        if !Path::new(path).exists() {
            return Err(format!(
                "Path {path:?} provided in landlock-rules does not exist"
            ));
        }
    }
    if args.has("restore") && (args.has("kernel") || args.has("firmware")) {
        return Err("--restore cannot be given with a payload".into());
    }
    Ok(())
}

/// What a snapshot's `config.json` holds, and `vm.info` answers as
/// `config`: what the VM was started with, in cloud-hypervisor's own shape
/// (v54's, whole, as it wrote it for a VM the agent started: its defaults
/// written out, an option not set left out).
#[derive(Clone, Debug)]
struct Config(serde_json::Value);

impl Config {
    fn of(args: &Args) -> Config {
        use serde_json::json;
        let list = |flag: &str| args.flags.get(flag).cloned().unwrap_or_default();
        let vcpus: u64 = args
            .option("cpus", "boot")
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        let memory = list("memory").first().cloned().unwrap_or_default();
        let mut payload = serde_json::Map::new();
        for key in ["kernel", "firmware", "cmdline"] {
            if let Some(value) = list(key).first() {
                payload.insert(key.into(), value.clone().into());
            }
        }
        let disks: Vec<_> = list("disk")
            .iter()
            .enumerate()
            .map(|(i, d)| disk(i, d))
            .collect();
        let nets: Vec<_> = list("net").iter().map(|n| net(n)).collect();
        let mut config = json!({
            "cpus": {"boot_vcpus": vcpus, "max_vcpus": vcpus, "kvm_hyperv": false, "max_phys_bits": 46,
                     "features": {"amx": false}, "nested": true, "core_scheduling": "Vm", "profile": "Host"},
            "memory": memory_of(&memory),
            "payload": payload,
            "disks": disks,
            "rng": {"pci_segment": 0, "src": "/dev/urandom"},
            "serial": match args.option("serial", "file") {
                Some(file) => json!({"file": file, "mode": "File"}),
                None => json!({"mode": "Null"}),
            },
            "console": {
                "mode": if list("console").first().is_some_and(|c| c == "off") { "Off" } else { "Tty" },
                "pci_segment": 0,
            },
            "debug_console": {"mode": "Off", "iobase": 233},
            "pvpanic": false,
            "iommu": false,
            "watchdog": false,
            "landlock_enable": args.has("landlock"),
        });
        if !nets.is_empty() {
            config["net"] = nets.into();
        }
        if let Some(socket) = args.option("vsock", "socket") {
            let cid: u64 = args
                .option("vsock", "cid")
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            config["vsock"] =
                json!({"id": "_vsock0", "pci_segment": 0, "cid": cid, "socket": socket});
        }
        if let Some(group) = list("rate-limit-group").first() {
            config["rate_limit_groups"] = json!([{
                "id": field(group, "id=").unwrap_or_default(),
                "rate_limiter_config": limiter(group),
            }]);
        }
        if let Some(rules) = args.flags.get("landlock-rules") {
            let rules: Vec<_> = rules
                .iter()
                .map(|r| json!({"path": field(r, "path="), "access": field(r, "access=")}))
                .collect();
            config["landlock_rules"] = rules.into();
        }
        Config(config)
    }

    fn serial(&self) -> Option<String> {
        self.0["serial"]["file"].as_str().map(str::to_owned)
    }

    fn disks(&self) -> Vec<String> {
        self.0["disks"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["path"].as_str().map(str::to_owned))
            .collect()
    }

    fn nets(&self) -> Vec<String> {
        self.0["net"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n["id"].as_str().map(str::to_owned))
            .collect()
    }

    fn disk_ids(&self) -> Vec<String> {
        self.0["disks"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, d)| d["id"].as_str().map_or(format!("_disk{i}"), str::to_owned))
            .collect()
    }

    fn memory_bytes(&self) -> u64 {
        self.0["memory"]["size"].as_u64().unwrap_or(0)
    }
}

/// The `key` value of an option list (`path=/x,readonly=on`).
fn field(text: &str, key: &str) -> Option<String> {
    text.split(',')
        .find_map(|kv| kv.strip_prefix(key).map(str::to_owned))
}

/// `--memory`'s options as v54 writes them.
fn memory_of(memory: &str) -> serde_json::Value {
    let megabytes = |v: Option<String>| {
        v.unwrap_or_default()
            .trim_end_matches(['M', 'm'])
            .parse::<u64>()
            .unwrap_or(0)
            << 20
    };
    let on = |key: &str| field(memory, key).is_some_and(|v| v == "on");
    let mut out = serde_json::json!({
        "size": megabytes(field(memory, "size=")),
        "mergeable": false,
        "hotplug_method": "Acpi",
        "shared": on("shared="),
        "hugepages": on("hugepages="),
        "prefault": false,
        "reserve": on("reserve="),
        "thp": true,
    });
    // The page size in bytes, left out when not named.
    let size = megabytes(field(memory, "hugepage_size="));
    if size > 0 {
        out["hugepage_size"] = size.into();
    }
    out
}

/// One `--disk` as v54 writes it.
fn disk(i: usize, d: &str) -> serde_json::Value {
    let mut out = serde_json::json!({
        "id": format!("_disk{i}"),
        "pci_segment": 0,
        "path": field(d, "path="),
        "readonly": field(d, "readonly=").is_some_and(|v| v == "on" || v == "true"),
        "direct": false,
        "num_queues": 1,
        "queue_size": 128,
        "vhost_user": false,
        "disable_io_uring": false,
        "disable_aio": false,
        "backing_files": field(d, "backing_files=").is_some_and(|v| v == "on"),
        "sparse": true,
        "image_type": match field(d, "image_type=").as_deref() {
            Some("raw") => "Raw",
            Some("qcow2") => "Qcow2",
            _ => "Unknown",
        },
        "lock_granularity": "ByteRange",
    });
    if let Some(group) = field(d, "rate_limit_group=") {
        out["rate_limit_group"] = group.into();
    }
    out
}

/// One `--net` as v54 writes it.
fn net(n: &str) -> serde_json::Value {
    let fds: Vec<i64> = field(n, "fd=")
        .and_then(|fd| fd.parse().ok())
        .into_iter()
        .collect();
    let mut out = serde_json::json!({
        "id": field(n, "id="),
        "pci_segment": 0,
        "mac": field(n, "mac="),
        "num_queues": 2,
        "queue_size": 256,
        "vhost_user": false,
        "vhost_mode": "Client",
        "fds": fds,
        "offload_tso": true,
        "offload_ufo": true,
        "offload_csum": true,
    });
    if n.contains("bw_size=") || n.contains("ops_size=") {
        out["rate_limiter_config"] = limiter(n);
    }
    out
}

/// A limiter's `bw_*` and `ops_*` options as v54 writes them (a bucket not
/// asked for null, and no one-time burst).
fn limiter(text: &str) -> serde_json::Value {
    let bucket = |kind: &str| {
        let number =
            |key: &str| field(text, &format!("{kind}_{key}=")).and_then(|v| v.parse::<u64>().ok());
        match (number("size"), number("refill_time")) {
            (Some(size), Some(refill)) => {
                serde_json::json!({"size": size, "one_time_burst": null, "refill_time": refill})
            }
            _ => serde_json::Value::Null,
        }
    };
    serde_json::json!({"bandwidth": bucket("bw"), "ops": bucket("ops")})
}

/// What a hypervisor its guest took over could write for its successor
/// (`STANDIN_SNAPSHOT_FORGE`) or say of itself (`STANDIN_INFO_FORGE`):
/// Landlock off, a rule of its own, a host disk, more vCPUs, or any field
/// set as `/json/pointer=JSON` (its parent must be there).
fn forge(config: &mut serde_json::Value, how: &str) {
    if let Some((pointer, value)) = how.split_once('=')
        && let Some((parent, key)) = pointer.rsplit_once('/')
    {
        let value = serde_json::from_str(value).unwrap_or(serde_json::Value::Null);
        if let Some(at) = config.pointer_mut(parent).and_then(|p| p.as_object_mut()) {
            at.insert(key.to_owned(), value);
        }
        return;
    }
    match how {
        "landlock-off" => config["landlock_enable"] = false.into(),
        "disk" => {
            if let Some(disks) = config["disks"].as_array_mut() {
                disks.push(serde_json::json!({"path": "/dev/sda", "image_type": "Raw"}));
            }
        }
        "vcpus" => {
            config["cpus"]["boot_vcpus"] = 64.into();
            config["cpus"]["max_vcpus"] = 64.into();
        }
        _ => config["landlock_rules"] = serde_json::json!([{"path": "/", "access": "rw"}]),
    }
}

/// Writes a snapshot of the VM started with `config` into `dir` (which
/// must exist, as for the real one).
fn write_snapshot(dir: &Path, config: &Config) -> Result<(), String> {
    if !dir.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    let mut json = config.0.clone();
    if let Some(forged) = knob("STANDIN_SNAPSHOT_FORGE") {
        forge(&mut json, &forged);
    }
    let json = serde_json::to_vec(&json).map_err(|e| e.to_string())?;
    let write = |name: &str, bytes: &[u8]| {
        std::fs::write(dir.join(name), bytes).map_err(|e| format!("{name}: {e}"))
    };
    write("config.json", &json)?;
    // A nonce for the chaos harness: a snapshot restored twice logs one
    // nonce twice.
    let nonce = format!("{}-{}", std::process::id(), unix_ns());
    let state =
        serde_json::json!({"standin": "device state", "nonce": nonce, "boot_id": boot_id()});
    write("state.json", state.to_string().as_bytes())?;
    // Sparse, as the real one writes a shared memory: the size of the
    // guest's memory, and only the pages it touched (a few) allocated.
    let memory = File::create(dir.join("memory-ranges")).map_err(|e| e.to_string())?;
    // A VMM its guest took over could write any size.
    let size = match knob("STANDIN_SNAPSHOT_BIG") {
        Some(_) => config.memory_bytes() * 2,
        None => config.memory_bytes(),
    };
    memory.set_len(size).map_err(|e| e.to_string())?;
    {
        use std::os::unix::fs::FileExt;
        for page in 0..4u64 {
            memory
                .write_at(&[0x5a; 4096], page * (1 << 20))
                .map_err(|e| e.to_string())?;
        }
    }
    if let Some(name) = knob("STANDIN_SNAPSHOT_EXTRA") {
        write(&name, b"planted")?;
    }
    if let Some(how) = knob("STANDIN_SNAPSHOT_FLOOD") {
        flood_dir(dir, how == "unnamed");
    }
    if knob("STANDIN_SNAPSHOT_HOLD").is_some() {
        // Open past the answer: written to whenever it likes.
        std::mem::forget(memory);
    }
    Ok(())
}

/// `bytes` of disk taken by `file`, without writing them where the
/// kernel can (fallocate), else written.
fn allocate(file: &File, bytes: i64) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        nix::fcntl::fallocate(file, nix::fcntl::FallocateFlags::empty(), 0, bytes)
            .map_err(std::io::Error::from)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let mut file = file;
        let chunk = vec![0x5a; 1 << 20];
        for _ in 0..bytes / (1 << 20) {
            file.write_all(&chunk)?;
        }
        Ok(())
    }
}

/// Fills `dir` with 16 MiB files, up to 1 GiB, logging the total after
/// each; `unnamed`: each unlinked as soon as made, and held open.
fn flood_dir(dir: &Path, unnamed: bool) {
    const FILE: i64 = 16 << 20;
    // Its stderr: the VM's hypervisor log, as its log file is.
    let log = Log(None);
    let mut held = Vec::new();
    for i in 0..64 {
        let path = dir.join(format!("flood-{i}"));
        let Ok(file) = File::create(&path) else {
            return;
        };
        if unnamed {
            let _ = std::fs::remove_file(&path);
        }
        if let Err(e) = allocate(&file, FILE) {
            log.line(&format!("standin-flood stopped: {e}"));
            return;
        }
        log.line(&format!("standin-flood {} MiB", (i + 1) * 16));
        held.push(file);
        // 1.6 GB/s: a fast disk's pace.
        std::thread::sleep(Duration::from_millis(10));
    }
    std::mem::forget(held);
}

/// Writes numbered lines to `path` at `rate` bytes a second, forever.
fn flood(path: &str, rate: u64, append: bool) {
    let mut open = OpenOptions::new();
    match append {
        true => open.append(true),
        false => open.write(true).truncate(true),
    };
    let Ok(mut file) = open.open(path) else {
        return;
    };
    const TICK_MS: u64 = 10;
    let per_tick = (rate * TICK_MS / 1000).max(1);
    let mut n = 0u64;
    loop {
        let mut chunk = String::new();
        while (chunk.len() as u64) < per_tick {
            chunk.push_str(&format!("serial line {n:012}\n"));
            n += 1;
        }
        if file.write_all(chunk.as_bytes()).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(TICK_MS));
    }
}

/// A knob from the environment (a stand-in run by hand), else from the
/// knobs its own binary carries after its last byte (a copy made by
/// `testkit::standin_hypervisor`: a VMM starts with an empty environment).
fn knob(name: &str) -> Option<String> {
    static CARRIED: std::sync::OnceLock<HashMap<String, String>> = std::sync::OnceLock::new();
    if let Some(v) = std::env::var(name).ok().filter(|v| !v.is_empty()) {
        return Some(v);
    }
    let carried = CARRIED.get_or_init(|| {
        let Some(own) = std::env::args().next() else {
            return HashMap::new();
        };
        // The tail alone: the knobs are a few lines at the end, and reading
        // the whole binary would add a millisecond to every start.
        let bytes = {
            use std::io::{Seek, SeekFrom};
            let mut tail = Vec::new();
            if let Ok(mut f) = File::open(own) {
                let len = f.metadata().map_or(0, |m| m.len());
                let _ = f.seek(SeekFrom::Start(len.saturating_sub(16 << 10)));
                let _ = f.read_to_end(&mut tail);
            }
            tail
        };
        let (start, end) = eitri_agent::testkit::STANDIN_KNOBS;
        let Some(body) = bytes.strip_suffix(end) else {
            return HashMap::new();
        };
        let Some(at) = body.windows(start.len()).rposition(|w| w == start) else {
            return HashMap::new();
        };
        String::from_utf8_lossy(&body[at + start.len()..])
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    });
    carried.get(name).cloned().filter(|v| !v.is_empty())
}

struct Log(Option<Mutex<File>>);

impl Log {
    fn line(&self, text: &str) {
        match &self.0 {
            Some(f) => {
                if let Ok(mut f) = f.lock() {
                    let _ = writeln!(f, "cloud-hypervisor: {text}");
                }
            }
            None => eprintln!("cloud-hypervisor: {text}"),
        }
    }
}

static BOOT_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The guest's boot id: new at a boot, the snapshot's at a restore.
fn boot_id() -> String {
    BOOT_ID
        .get_or_init(|| {
            std::fs::read_to_string("/proc/sys/kernel/random/uuid")
                .map(|u| u.trim().to_owned())
                .unwrap_or_else(|_| format!("{:032x}", unix_ns()))
        })
        .clone()
}

fn unix_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// What the knobs ask of this VMM's load: its log flooded, its vCPUs
/// spinning for a CPU cap to hold back.
fn load(args: &Args) {
    if let (Some(path), Some(rate)) = (
        args.flags.get("log-file").and_then(|v| v.first()).cloned(),
        knob("STANDIN_LOG_FLOOD").and_then(|v| v.parse::<u64>().ok()),
    ) {
        std::thread::spawn(move || flood(&path, rate, true));
    }
    // A guest that never idles: n vCPU threads spinning, for a CPU cap to
    // hold back.
    if let Some(n) = knob("STANDIN_BURN_CPUS").and_then(|v| v.parse::<u32>().ok()) {
        for _ in 0..n {
            std::thread::spawn(|| {
                let mut x = 0u64;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            });
        }
    }
}

/// What the knobs ask it to try as a VMM its guest took over (or one that
/// crashes), each tried and its outcome logged.
fn tried_by_a_guest(log: &Arc<Log>) {
    if let Some(ms) = knob("STANDIN_CRASH_AFTER_MS").and_then(|v| v.parse::<u64>().ok()) {
        let log = Arc::clone(log);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            log.line("Error running VM: vCPU error: KVM internal error (emulation failure)");
            std::process::exit(1);
        });
    }
    if let Some(at) = knob("STANDIN_CONNECT") {
        let said = match std::net::TcpStream::connect_timeout(
            &at.parse()
                .unwrap_or_else(|_| std::net::SocketAddr::from(([127, 0, 0, 1], 1))),
            Duration::from_secs(1),
        ) {
            Ok(_) => "reached".to_owned(),
            Err(e) => format!("refused: {e}"),
        };
        log.line(&format!("standin-connect {at} {said}"));
    }
    if let Some(paths) = knob("STANDIN_LOOK") {
        // What this VMM can see of the host: each path, there or not.
        for path in paths.split(',') {
            let seen = if std::fs::symlink_metadata(path).is_ok() {
                "there"
            } else {
                "absent"
            };
            log.line(&format!("standin-look {path} {seen}"));
        }
    }
    if let Some(dir) = knob("STANDIN_WRITE_INTO") {
        // What a VMM its guest took over tries: storage of its own.
        let said = match File::create(Path::new(&dir).join("standin-planted")) {
            Ok(_) => "written".to_owned(),
            Err(e) => format!("refused: {e}"),
        };
        log.line(&format!("standin-write {dir} {said}"));
    }
    if let Some(path) = knob("STANDIN_GROW") {
        // What a VMM its guest took over tries: the file grown to 1 TiB.
        let said = match OpenOptions::new().write(true).open(&path) {
            Ok(f) => match f.set_len(1 << 40) {
                Ok(()) => "grown".to_owned(),
                Err(e) => format!("refused: {e}"),
            },
            Err(e) => format!("refused: {e}"),
        };
        log.line(&format!("standin-grow {path} {said}"));
    }
    if knob("STANDIN_FORK_CHILD").is_some() {
        // In a process group of its own, as a VMM its guest took over
        // would start it, so no signal to the VMM's group reaches it.
        use std::os::unix::process::CommandExt;
        // Itself again (its own binary is all it sees), asleep.
        let own = std::env::args().next().unwrap_or_default();
        match std::process::Command::new(own)
            .arg("--standin-sleep")
            .process_group(0)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
        {
            Ok(child) => log.line(&format!("standin-child pid={}", child.id())),
            Err(e) => log.line(&format!("standin-child not started: {e}")),
        }
    }
}

fn main() {
    let started_ns = unix_ns();
    let args = Args::parse();
    if args.has("standin-sleep") {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    if args.has("version") {
        println!("cloud-hypervisor v53.0");
        return;
    }
    let log = Arc::new(Log(args
        .flags
        .get("log-file")
        .and_then(|v| v.first())
        // Truncated, as cloud-hypervisor's own `File::create` does: a VMM's
        // log holds only what it said (seen on v54: a restarted VMM's log
        // began with its own first line).
        .and_then(|p| File::create(p).ok())
        .map(Mutex::new)));
    if let Err(e) = check(&args, &log) {
        log.line(&format!("Error: {e}"));
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    if let Some(msg) = knob("STANDIN_FAIL_START") {
        log.line(&format!("Error: {msg}"));
        std::process::exit(1);
    }
    if knob("STANDIN_IGNORE_SHUTDOWN").is_some() {
        // SAFETY: setting SIGTERM's disposition to ignore installs no
        // handler code; it is done before any other thread exists.
        unsafe {
            let _ = nix::sys::signal::signal(
                nix::sys::signal::Signal::SIGTERM,
                nix::sys::signal::SigHandler::SigIgn,
            );
        }
    }
    // A restore takes its VM from the snapshot's config instead.
    let restored = match args.option("restore", "source_url") {
        Some(url) => match restore(&args, &url, &log) {
            Ok(config) => Some(config),
            Err(e) => {
                log.line(&format!("Error restoring VM: {e}"));
                std::process::exit(1);
            }
        },
        None => None,
    };
    if let (None, Some(serial)) = (&restored, args.option("serial", "file")) {
        let panic = match knob("STANDIN_SERIAL_PANIC") {
            Some(_) => {
                "[    0.912345] Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)\n"
            }
            None => "",
        };
        let _ = std::fs::write(&serial, format!("eitri standin: booting\n{panic}login: \n"));
        if let Some(rate) = knob("STANDIN_SERIAL_FLOOD").and_then(|v| v.parse::<u64>().ok()) {
            std::thread::spawn(move || flood(&serial, rate, false));
        }
    }
    load(&args);
    // The NIC's fd is held for the process's life, like a real VMM holds its
    // tap: the tap exists exactly as long as this process does.
    let _net_fd = args.option("net", "fd");
    if knob("STANDIN_GUEST_TCP").is_some()
        && let Some((fd, mac)) = first_nic(&args, restored.as_ref())
    {
        let log = Arc::clone(&log);
        std::thread::spawn(move || wire::answer(fd, mac, |said| log.line(said)));
    }
    tried_by_a_guest(&log);
    let vsock = match &restored {
        Some(config) => config.0["vsock"]["socket"].as_str().map(str::to_owned),
        None => args.option("vsock", "socket"),
    };
    if let Some(socket) = vsock {
        let say = Arc::clone(&log);
        let ms = |name| {
            knob(name)
                .and_then(|v| v.parse().ok())
                .map_or(Duration::ZERO, Duration::from_millis)
        };
        let timing = (
            ms("STANDIN_GUEST_UP_AFTER_MS"),
            ms("STANDIN_GUEST_STATUS_AFTER_MS"),
        );
        let scripted =
            guest::Scripted::new(boot_id(), timing, Arc::new(move |l: &str| say.line(l)));
        guest::listen(
            Path::new(&socket),
            Arc::new(scripted),
            knob("STANDIN_GUEST_AGENT"),
        );
    }
    if knob("STANDIN_NO_SOCKET").is_some() {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    listen(&args, &log, started_ns, restored);
}

/// Serves the API on the agent's socket: passed in listening (nothing to
/// bind or lock), or a path bound here, as cloud-hypervisor does, refused
/// while another instance holds it.
fn listen(args: &Args, log: &Arc<Log>, started_ns: u128, restored: Option<Config>) {
    // The agent's socket, passed in listening: nothing to bind or lock.
    if let Some(fd) = args.option("api-socket", "fd") {
        let Some(fd) = fd.parse::<i32>().ok().filter(|fd| *fd > 2) else {
            log.line(&format!(
                "Error: --api-socket fd={fd} is not an inherited fd"
            ));
            std::process::exit(1);
        };
        use std::os::fd::FromRawFd;
        // SAFETY: the fd was inherited for this purpose and nothing else in
        // this process owns it.
        let listener = unsafe { UnixListener::from_raw_fd(fd) };
        serve_all(listener, args, log, started_ns, None, restored);
        return;
    }
    let Some(socket) = args.option("api-socket", "path").map(PathBuf::from) else {
        log.line("Error: no --api-socket path= or fd=");
        std::process::exit(1);
    };
    if UnixStream::connect(&socket).is_ok() {
        log.line(&format!(
            "Error: API socket {} is already in use by another running instance",
            socket.display()
        ));
        std::process::exit(1);
    }
    let _ = std::fs::remove_file(&socket);
    let lock_path = PathBuf::from(format!("{}.lock", socket.display()));
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path);
    let _held = lock.ok().filter(|f| f.try_lock().is_ok());
    let listener = match UnixListener::bind(&socket) {
        Ok(l) => l,
        Err(e) => {
            log.line(&format!("Error: cannot bind {}: {e}", socket.display()));
            std::process::exit(1);
        }
    };
    serve_all(listener, args, log, started_ns, Some(socket), restored);
}

/// A restore from `url` (`file://DIR`, as `--restore source_url=` gives
/// it): the snapshot's config read back, its NICs' new taps checked
/// against it, its serial file truncated (as the real one does) with a
/// resume line, and its root disk's inode logged for the chaos harness.
/// The first NIC's tap fd and MAC: from `--net fd=…,mac=…` at a boot, from
/// the restore's `net_fds=[net0@[fd]]` and the snapshot's config at a
/// restore.
fn first_nic(args: &Args, restored: Option<&Config>) -> Option<(i32, [u8; 6])> {
    let (fd, mac) = match restored {
        None => (args.option("net", "fd")?, args.option("net", "mac")?),
        Some(config) => {
            let arg = args.flags.get("restore")?.first()?;
            let fd = arg.split("net_fds=[").nth(1)?.split('[').nth(1)?;
            let fd = fd.split(']').next()?.to_owned();
            let mac = config.0["net"][0]["mac"].as_str()?.to_owned();
            (fd, mac)
        }
    };
    let mut octets = [0u8; 6];
    let mut parts = mac.split(':');
    for o in &mut octets {
        *o = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    Some((fd.parse().ok()?, octets))
}

fn restore(args: &Args, url: &str, log: &Log) -> Result<Config, String> {
    if knob("STANDIN_RESTORE_FAIL").is_some() {
        return Err("restore refused (STANDIN_RESTORE_FAIL)".into());
    }
    let dir = url
        .strip_prefix("file://")
        .ok_or_else(|| format!("{url}: not a file:// URL"))?;
    let dir = Path::new(dir);
    let text = std::fs::read(dir.join("config.json")).map_err(|e| format!("config.json: {e}"))?;
    let config = Config(serde_json::from_slice(&text).map_err(|e| format!("config.json: {e}"))?);
    let state = std::fs::read(dir.join("state.json")).map_err(|e| format!("state.json: {e}"))?;
    let state = serde_json::from_slice::<serde_json::Value>(&state).unwrap_or_default();
    let nonce = state["nonce"].as_str().unwrap_or_default().to_owned();
    // Its memory opened read-only and read, as cloud-hypervisor's restore
    // does: a VMM's user that may not read it fails here.
    match File::open(dir.join("memory-ranges")) {
        Ok(mut memory) => {
            let mut page = [0u8; 4096];
            memory
                .read(&mut page)
                .map_err(|e| format!("memory-ranges: {e}"))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("memory-ranges: {e}")),
    }
    // The guest goes on with the boot it had.
    if let Some(boot) = state["boot_id"].as_str() {
        let _ = BOOT_ID.set(boot.to_owned());
    }
    // `net_fds=[net0@[4],net1@[5]]`: each id must be one of the config's.
    let restore_arg = args
        .flags
        .get("restore")
        .and_then(|v| v.first())
        .cloned()
        .unwrap_or_default();
    if let Some(list) = restore_arg.split("net_fds=[").nth(1) {
        // The list ends where its brackets close: `net0@[4],net1@[5]]`.
        let mut depth = 1;
        let end = list
            .char_indices()
            .find_map(|(i, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                (depth == 0).then_some(i)
            })
            .unwrap_or(list.len());
        for item in list[..end].split("],") {
            let id = item.split('@').next().unwrap_or("");
            if !id.is_empty() && !config.nets().iter().any(|n| n == id) {
                return Err(format!("no net device {id:?} in the snapshot"));
            }
        }
    }
    if let Some(serial) = &config.serial() {
        std::fs::write(serial, "eitri standin: resumed\n").map_err(|e| format!("{serial}: {e}"))?;
    }
    log.line(&format!("standin-restored nonce={nonce}"));
    Ok(config)
}

/// Serves the API on `listener` until `vmm.shutdown` (which removes
/// `socket`, the path this process bound, if it bound one); `restored`:
/// the config of the snapshot it restored.
fn serve_all(
    listener: UnixListener,
    args: &Args,
    log: &Arc<Log>,
    started_ns: u128,
    socket: Option<PathBuf>,
    restored: Option<Config>,
) {
    // For make bench-boot: this process's own time from main to a socket
    // that accepts, so the agent's overhead can be told apart from it.
    log.line(&format!(
        "standin-timing main_ns={started_ns} ready_ns={}",
        unix_ns()
    ));
    // For the chaos harness: which root disk this VMM runs on, so a disk
    // replaced under it (a new inode at its path) can be told.
    let resumes = args
        .option("restore", "resume")
        .is_some_and(|v| v == "true" || v == "on");
    let first = match &restored {
        Some(_) if !resumes => "Paused",
        _ => "Running",
    };
    let config = Arc::new(restored.unwrap_or_else(|| Config::of(args)));
    if let (Some(disk), Some(rate)) = (
        config.disks().first().cloned(),
        knob("STANDIN_DISK_READ").and_then(|v| v.parse::<u64>().ok()),
    ) {
        std::thread::spawn(move || counters::read_disk(&disk, rate));
    }
    if let Some(disk) = config.disks().first() {
        use std::os::unix::fs::MetadataExt;
        let ino = std::fs::metadata(disk).map_or(0, |m| m.ino());
        log.line(&format!(
            "standin-disk pid={} ino={ino}",
            std::process::id()
        ));
    }
    log.line("VM booted");
    let state = Arc::new(Mutex::new(String::from(first)));
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let (state, log, socket, config) = (
            Arc::clone(&state),
            Arc::clone(log),
            socket.clone(),
            Arc::clone(&config),
        );
        std::thread::spawn(move || serve(conn, &state, &log, socket.as_deref(), &config));
    }
}

fn serve(
    conn: UnixStream,
    state: &Mutex<String>,
    log: &Log,
    socket: Option<&Path>,
    config: &Config,
) {
    let Ok(write_half) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    let mut out = write_half;
    loop {
        let Some((method, path, body)) = read_request(&mut reader) else {
            return;
        };
        if knob("STANDIN_FLOOD_ANSWERS").is_some() {
            // A status line that never ends, for as long as the peer reads.
            let chunk = [b'A'; 64 << 10];
            while out.write_all(&chunk).is_ok() {}
            return;
        }
        let (code, reply, then_exit) = answer(&method, &path, &body, state, config);
        // A guest's pauses and resumes, in order with what its guest agent
        // was asked (the same log).
        if code == 204 && matches!(path.as_str(), "/api/v1/vm.pause" | "/api/v1/vm.resume") {
            log.line(&format!("standin-api {method} {path}"));
        }
        let head = format!(
            "HTTP/1.1 {code} \r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            reply.len()
        );
        if out
            .write_all(head.as_bytes())
            .and_then(|()| out.write_all(reply.as_bytes()))
            .is_err()
        {
            return;
        }
        let _ = out.flush();
        if then_exit {
            log.line("VMM shutdown");
            if let Some(socket) = socket {
                let _ = std::fs::remove_file(socket);
            }
            std::process::exit(0);
        }
    }
}

/// One request off the connection: its method, path and body; `None`
/// once the peer is gone.
fn read_request(reader: &mut BufReader<UnixStream>) -> Option<(String, String, Vec<u8>)> {
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
    );
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            return None;
        }
        if h == "\r\n" {
            break;
        }
        if let Some((n, v)) = h.split_once(':')
            && n.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).ok()?;
    Some((method, path, body))
}

/// What the VMM answers `method` on `path`: the status code, the body,
/// and whether it exits once the answer is sent (as cloud-hypervisor does
/// on `vmm.shutdown`, and when its guest powers off).
fn answer(
    method: &str,
    path: &str,
    body: &[u8],
    state: &Mutex<String>,
    config: &Config,
) -> (u16, String, bool) {
    if (method, path) == ("GET", "/api/v1/vm.counters") {
        return counters::request(state, config);
    }
    let ignore = knob("STANDIN_IGNORE_SHUTDOWN").is_some();
    let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
    match (method, path) {
        ("GET", "/api/v1/vmm.ping") => (
            200,
            format!(
                r#"{{"build_version":"v53.0-standin","version":"53.0.0","pid":{},"features":[]}}"#,
                std::process::id()
            ),
            false,
        ),
        ("GET", "/api/v1/vm.info") if *s == "Deleted" => (
            404,
            r#"["Error from API","The VM info is not available","VM is not created"]"#.to_owned(),
            false,
        ),
        ("GET", "/api/v1/vm.info") => {
            let mut config = config.0.clone();
            if let Some(forged) = knob("STANDIN_INFO_FORGE") {
                forge(&mut config, &forged);
            }
            let info = serde_json::json!({"state": *s, "config": config, "memory_actual_size": 0});
            (200, info.to_string(), false)
        }
        ("PUT", "/api/v1/vm.boot") | ("PUT", "/api/v1/vm.resume") => {
            *s = "Running".into();
            (204, String::new(), false)
        }
        ("PUT", "/api/v1/vm.shutdown") => {
            *s = "Created".into();
            (204, String::new(), false)
        }
        ("PUT", "/api/v1/vm.power-button") => {
            if !ignore {
                // The guest hears the button and powers off, and
                // a real VMM exits 0 when its guest does.
                *s = "Shutdown".into();
            }
            (204, String::new(), !ignore)
        }
        ("PUT", "/api/v1/vm.pause") => {
            *s = "Paused".into();
            (204, String::new(), false)
        }
        ("PUT", "/api/v1/vm.snapshot") if *s != "Paused" => (
            500,
            r#"["Error from API","The VM could not be snapshotted","VM is not paused"]"#.to_owned(),
            false,
        ),
        ("PUT", "/api/v1/vm.snapshot") if knob("STANDIN_SNAPSHOT_FAIL").is_some() => (
            500,
            r#"["Error from API","The VM could not be snapshotted","STANDIN_SNAPSHOT_FAIL"]"#
                .to_owned(),
            false,
        ),
        ("PUT", "/api/v1/vm.snapshot") => {
            let dir = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("destination_url")?.as_str().map(str::to_owned))
                .and_then(|url| url.strip_prefix("file://").map(PathBuf::from));
            match dir.map(|d| write_snapshot(&d, config)) {
                Some(Ok(())) => (204, String::new(), false),
                Some(Err(e)) => (
                    500,
                    format!(
                        r#"["Error from API","The VM could not be snapshotted","{}"]"#,
                        e.replace('"', "'")
                    ),
                    false,
                ),
                None => (
                    400,
                    r#"["Error from API","no destination_url"]"#.to_owned(),
                    false,
                ),
            }
        }
        ("PUT", "/api/v1/vm.delete") => {
            *s = "Deleted".into();
            (204, String::new(), false)
        }
        ("PUT", "/api/v1/vmm.shutdown") => (200, String::new(), !ignore),
        _ => (
            404,
            r#"["Error from API","unknown endpoint"]"#.to_owned(),
            false,
        ),
    }
}
