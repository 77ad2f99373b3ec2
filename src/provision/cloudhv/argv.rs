//! The VMM's command line: a pure function of what the VM is, how guests
//! boot, and where the VM's files are. Nothing here touches the host, so
//! every shape of it is tested as golden output, without root.
//!
//! The flags are cloud-hypervisor's own (v51 and later, as its `--help`
//! names them):
//! the API socket as an inherited listening fd (the agent binds it, so the
//! jailed VMM creates nothing in the run dir), the guest's kernel or
//! firmware, the disks (root, then the seed read-only, then the volumes in
//! the spec's order), one `--net` per NIC as an inherited tap fd named
//! `net0`, `net1` (a restore hands each its new tap by that name), serial
//! output to a file and the virtio console off (it would be the agent's
//! tty), a vsock device whose socket the VMM binds in a directory of its
//! own (the host reaches the guest agent through it, see [`crate::guest`]),
//! CPUs, memory shared (a memfd: its snapshot is written sparse,
//! only the pages the guest touched), the VMM's own log, and Landlock when
//! the host has it (the VMM then confines itself to the files this
//! command line names, and its snapshot directory).
//!
//! A resume starts the VMM with [`restore_argv`] instead: the API socket,
//! the snapshot to restore (its memory faulted in on demand where the host
//! allows it), the new taps by NIC name, resumed as soon as it is restored.
//! The VM's configuration (disks, serial file, Landlock rules) is the
//! snapshot's own.
//!
//! The root disk's argument, `path=<state>/vms/<id>/disk.raw,…`, and a
//! restore's `source_url=file://<state>/vms/<id>/snapshot,…` are also how
//! the agent knows a VM's VMM by its command line.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::model::{Mac, VmLimits};
use crate::provision::jail::view::{Access, Visible};

/// How guests boot on this host.
#[derive(Clone, Copy, Debug)]
pub enum GuestImage<'a> {
    /// A PVH kernel, with its command line.
    Kernel { kernel: &'a Path, cmdline: &'a str },
    /// Firmware (hypervisor-fw, CLOUDHV.fd) that boots the root disk.
    Firmware(&'a Path),
}

/// Where one VM's files are.
#[derive(Clone, Debug)]
pub struct VmFiles {
    pub root_disk: PathBuf,
    pub seed: PathBuf,
    pub volumes: Vec<PathBuf>,
    pub serial_log: PathBuf,
    pub log: PathBuf,
    /// Where the VMM writes a snapshot when the VM is suspended.
    pub snapshot_work: PathBuf,
    /// The vsock socket the VMM binds for the host to reach the guest
    /// agent; its directory is the VMM's.
    pub guest_socket: PathBuf,
}

/// Everything a VMM is given to see: what its binary needs to run
/// (`runtime`, see [`runtime_of`](crate::provision::jail::view::runtime_of)), the binary, its kernel or firmware
/// (`boot`) and its seed read-only (it reads them, and must not grow or
/// change them), its disks, volumes, serial and log files, its vsock
/// socket's directory, and the devices it opens (`kvm`, `/dev/null`,
/// `/dev/urandom`).
pub fn what_a_vmm_sees(
    mut runtime: Vec<Visible>,
    hypervisor: &Path,
    boot: &[&Path],
    files: &VmFiles,
    kvm: &Path,
) -> Vec<Visible> {
    runtime.push(Visible::new(hypervisor, Access::Execute));
    for boot in boot {
        runtime.push(Visible::new(boot, Access::Read));
    }
    runtime.push(Visible::new(&files.seed, Access::Read));
    for rw in [&files.root_disk, &files.serial_log, &files.log]
        .into_iter()
        .chain(&files.volumes)
    {
        runtime.push(Visible::new(rw, Access::Write));
    }
    runtime.push(Visible::new(&files.snapshot_work, Access::Write));
    if let Some(vsock) = files.guest_socket.parent() {
        runtime.push(Visible::new(vsock, Access::Write));
    }
    runtime.push(Visible::new(kvm, Access::Write));
    runtime.push(Visible::new("/dev/null", Access::Write));
    runtime.push(Visible::new("/dev/urandom", Access::Read));
    runtime
}

/// What a VMM that restores a snapshot sees besides: the snapshot, read
/// only (it is spent once the guest runs; nothing may change it before),
/// and, to fault its memory in on demand, the host's `userfaultfd` device.
/// No other VMM sees that device: its access (an ACL for the VMMs' group)
/// is gated by the view.
pub fn what_a_restore_sees(snapshot: &Path, userfaultfd: Option<&Path>) -> Vec<Visible> {
    let mut out = vec![Visible::new(snapshot, Access::Read)];
    if let Some(device) = userfaultfd {
        out.push(Visible::new(device, Access::Write));
    }
    out
}

/// A NIC as the VMM is given it: a tap fd it inherits, and the guest MAC.
#[derive(Clone, Copy, Debug)]
pub struct Nic {
    pub fd: i32,
    pub mac: Mac,
}

/// The guest's vsock address. Each VM has a vsock device of its own,
/// served by its VMM over a unix socket (no host vsock is involved), so
/// every guest can be 3, the first a guest may have.
pub(super) const GUEST_CID: u32 = 3;

/// Every disk is raw, and its format is never probed: a guest owns the
/// bytes of its disks and could write a QCOW2 header naming a host file as
/// its backing file (GHSA-jmr4-g2hv-mjj6). Since cloud-hypervisor v51.
const RAW: &str = ",image_type=raw,backing_files=off";

/// What the VM is given besides its files.
#[derive(Clone, Debug)]
pub struct VmShape<'a> {
    /// The inherited listening socket of its API.
    pub api_fd: i32,
    pub nics: &'a [Nic],
    pub vcpus: u32,
    pub mem_mb: u64,
    /// Its memory on 2 MiB huge pages.
    pub hugepages: bool,
    pub landlock: bool,
    /// The limits in force (0: none); the VMM holds the disk and NIC ones.
    pub limits: VmLimits,
}

/// The refill time of the VMM's token buckets: its limiter, once a bucket
/// is empty, waits on a timer of at least 100 ms, so a refill of 1 s keeps
/// that wait a tenth of the refill or less and the rate over any second
/// within the set one (after a first bucket's burst, which a refill this
/// long makes one second's worth).
pub(super) const REFILL_MS: u64 = 1000;

/// The rate-limit group every disk but the seed is in: one budget for the
/// VM's disks together.
pub(super) const DISK_GROUP: &str = "disks";

/// The sizes of the VMM's token buckets for `limits`, each refilled every
/// [`REFILL_MS`] (0: no bucket): the disks' bytes and operations, and each
/// NIC's bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Buckets {
    pub disk_bytes: u64,
    pub disk_ops: u64,
    pub net_bytes: u64,
}

impl Buckets {
    pub(super) fn of(l: VmLimits) -> Buckets {
        let per_refill = |per_second: u64| per_second * REFILL_MS / 1000;
        Buckets {
            disk_bytes: per_refill(u64::from(l.disk_mbps) * 1_000_000),
            disk_ops: per_refill(u64::from(l.disk_iops)),
            // Mbit/s to bytes a second.
            net_bytes: per_refill(u64::from(l.net_mbps) * 125_000),
        }
    }
}

/// `bw_size=…,bw_refill_time=…` and `ops_size=…,ops_refill_time=…` for
/// buckets of `bytes` and `ops` (0: none), each with a leading comma.
fn buckets(bytes: u64, ops: u64) -> String {
    let mut text = String::new();
    if bytes != 0 {
        text.push_str(&format!(",bw_size={bytes},bw_refill_time={REFILL_MS}"));
    }
    if ops != 0 {
        text.push_str(&format!(",ops_size={ops},ops_refill_time={REFILL_MS}"));
    }
    text
}

/// The arguments after the program name.
pub fn argv(image: Option<GuestImage<'_>>, files: &VmFiles, shape: &VmShape<'_>) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    let mut arg = |a: OsString| args.push(a);
    arg("--api-socket".into());
    arg(format!("fd={}", shape.api_fd).into());
    match image {
        Some(GuestImage::Kernel { kernel, cmdline }) => {
            arg("--kernel".into());
            arg(kernel.into());
            arg("--cmdline".into());
            arg(cmdline.into());
        }
        Some(GuestImage::Firmware(firmware)) => {
            arg("--firmware".into());
            arg(firmware.into());
        }
        None => {}
    }
    let sizes = Buckets::of(shape.limits);
    let disk_buckets = buckets(sizes.disk_bytes, sizes.disk_ops);
    let grouped = if disk_buckets.is_empty() {
        RAW.to_owned()
    } else {
        arg("--rate-limit-group".into());
        arg(format!("id={DISK_GROUP}{disk_buckets}").into());
        format!("{RAW},rate_limit_group={DISK_GROUP}")
    };
    arg("--disk".into());
    arg(option("path=", &files.root_disk, &grouped));
    arg(option("path=", &files.seed, &format!(",readonly=on{RAW}")));
    for volume in &files.volumes {
        arg(option("path=", volume, &grouped));
    }
    if !shape.nics.is_empty() {
        let nic_buckets = buckets(sizes.net_bytes, 0);
        arg("--net".into());
        for (i, nic) in shape.nics.iter().enumerate() {
            arg(format!("fd={},mac={},id={}{nic_buckets}", nic.fd, nic.mac, NicId(i)).into());
        }
    }
    arg("--serial".into());
    arg(option("file=", &files.serial_log, ""));
    arg("--console".into());
    arg("off".into());
    arg("--vsock".into());
    arg(option(
        &format!("cid={GUEST_CID},socket="),
        &files.guest_socket,
        "",
    ));
    arg("--cpus".into());
    arg(format!("boot={}", shape.vcpus).into());
    arg("--memory".into());
    // The page size is named: without it the VMM asks a hugetlbfs mount
    // for it, and a host need not have one (the pages come from a memfd).
    // Reserved at the boot's mapping: a pool run dry then fails a boot,
    // where unreserved pages would kill the guest at its first touch of
    // one the pool no longer has.
    let pages = match shape.hugepages {
        true => ",hugepages=on,hugepage_size=2M,reserve=on",
        false => "",
    };
    arg(format!("size={}M,shared=on{pages}", shape.mem_mb).into());
    arg("--log-file".into());
    arg(files.log.clone().into_os_string());
    if shape.landlock {
        arg("--landlock".into());
        arg("--landlock-rules".into());
        arg(option("path=", &files.snapshot_work, ",access=rw"));
    }
    args
}

/// What a new VMM does once it runs.
#[derive(Clone, Copy, Debug)]
pub enum Launch<'a> {
    /// Boots its guest from the disks ([`argv`]).
    Boot,
    /// Restores the snapshot at `snapshot` (read-only in its view), its
    /// guest held paused ([`restore_argv`]).
    Restore {
        snapshot: &'a Path,
        memory: MemoryRestore,
    },
}

/// How a restored VMM fills its guest's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryRestore {
    /// Each page read from the snapshot on its first touch (userfaultfd):
    /// the guest runs in milliseconds, whatever its size.
    OnDemand,
    /// The whole snapshot read before the guest runs.
    Copy,
}

/// The arguments of a VMM that restores the snapshot at `snapshot`, its
/// guest paused until a `vm.resume` (the engine records the resume
/// first): its API socket and NICs as at boot (`shape`; its vCPUs and
/// memory are the snapshot's), its log.
pub fn restore_argv(
    snapshot: &Path,
    memory: MemoryRestore,
    log: &Path,
    shape: &VmShape<'_>,
) -> Vec<OsString> {
    let mut source = option("source_url=file://", snapshot, "");
    source.push(match memory {
        MemoryRestore::OnDemand => ",memory_restore_mode=ondemand",
        MemoryRestore::Copy => ",memory_restore_mode=copy",
    });
    if !shape.nics.is_empty() {
        let nets: Vec<String> = shape
            .nics
            .iter()
            .enumerate()
            .map(|(i, nic)| format!("{}@[{}]", NicId(i), nic.fd))
            .collect();
        source.push(format!(",net_fds=[{}]", nets.join(",")));
    }
    vec![
        "--api-socket".into(),
        format!("fd={}", shape.api_fd).into(),
        "--restore".into(),
        source,
        "--log-file".into(),
        log.as_os_str().to_owned(),
    ]
}

/// The name of the VM's `i`-th NIC, as its VMM knows it.
pub(super) struct NicId(pub usize);

impl std::fmt::Display for NicId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "net{}", self.0)
    }
}

/// `key` + the path + `rest`, as one argument, whatever bytes the path has.
fn option(key: &str, path: &Path, rest: &str) -> OsString {
    let mut out = OsString::from(key);
    out.push(path);
    out.push(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(volumes: &[&str]) -> VmFiles {
        VmFiles {
            root_disk: "/var/lib/eitri/vms/web-1/disk.raw".into(),
            seed: "/var/lib/eitri/vms/web-1/seed.iso".into(),
            volumes: volumes.iter().map(PathBuf::from).collect(),
            serial_log: "/var/lib/eitri/vms/web-1/serial.log".into(),
            log: "/var/lib/eitri/vms/web-1/hypervisor.log".into(),
            snapshot_work: "/var/lib/eitri/vms/web-1/snapshot.tmp".into(),
            guest_socket: "/run/eitri/0123456789abcdef.vsock/guest.sock".into(),
        }
    }

    fn kernel() -> Option<GuestImage<'static>> {
        Some(GuestImage::Kernel {
            kernel: Path::new("/srv/vmlinux"),
            cmdline: "console=ttyS0 root=/dev/vda1 rw",
        })
    }

    fn nic(fd: i32, last: u8) -> Nic {
        Nic {
            fd,
            mac: Mac::from([0x02, 0, 0, 0, 0, last]),
        }
    }

    fn shape(nics: &[Nic], vcpus: u32, mem_mb: u64) -> VmShape<'_> {
        VmShape {
            api_fd: 3,
            nics,
            vcpus,
            mem_mb,
            hugepages: false,
            landlock: true,
            limits: VmLimits::default(),
        }
    }

    fn text(args: Vec<OsString>) -> Vec<String> {
        args.into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn kernel_boot_with_one_nic() {
        let args = argv(kernel(), &files(&[]), &shape(&[nic(4, 1)], 2, 512));

        assert_eq!(
            text(args),
            [
                "--api-socket",
                "fd=3",
                "--kernel",
                "/srv/vmlinux",
                "--cmdline",
                "console=ttyS0 root=/dev/vda1 rw",
                "--disk",
                "path=/var/lib/eitri/vms/web-1/disk.raw,image_type=raw,backing_files=off",
                "path=/var/lib/eitri/vms/web-1/seed.iso,readonly=on,image_type=raw,backing_files=off",
                "--net",
                "fd=4,mac=02:00:00:00:00:01,id=net0",
                "--serial",
                "file=/var/lib/eitri/vms/web-1/serial.log",
                "--console",
                "off",
                "--vsock",
                "cid=3,socket=/run/eitri/0123456789abcdef.vsock/guest.sock",
                "--cpus",
                "boot=2",
                "--memory",
                "size=512M,shared=on",
                "--log-file",
                "/var/lib/eitri/vms/web-1/hypervisor.log",
                "--landlock",
                "--landlock-rules",
                "path=/var/lib/eitri/vms/web-1/snapshot.tmp,access=rw",
            ]
        );
    }

    #[test]
    fn disk_limits_hold_the_root_disk_and_volumes_together_but_not_the_seed() {
        let volumes = ["/var/lib/eitri/volumes/data-1"];
        let nics = [nic(4, 1)];
        let mut limited = shape(&nics, 1, 128);
        limited.limits = VmLimits {
            disk_mbps: 200,
            disk_iops: 5000,
            ..VmLimits::default()
        };

        let args = text(argv(kernel(), &files(&volumes), &limited));

        let group = args.iter().position(|a| a == "--rate-limit-group");
        assert_eq!(
            group.map(|g| args[g + 1].as_str()),
            Some(
                "id=disks,bw_size=200000000,bw_refill_time=1000,ops_size=5000,ops_refill_time=1000"
            )
        );
        let disks: Vec<&String> = args.iter().filter(|a| a.starts_with("path=")).collect();
        assert!(disks[0].ends_with(",rate_limit_group=disks"), "{disks:?}");
        assert!(!disks[1].contains("rate_limit_group"), "{disks:?}");
        assert!(disks[2].ends_with(",rate_limit_group=disks"), "{disks:?}");
    }

    #[test]
    fn a_nic_limit_is_each_nics_own_bucket_in_bytes() {
        let nics = [nic(4, 1), nic(5, 2)];
        let mut limited = shape(&nics, 1, 128);
        limited.limits = VmLimits {
            net_mbps: 100,
            ..VmLimits::default()
        };

        let args = text(argv(kernel(), &files(&[]), &limited));

        let net = args.iter().position(|a| a == "--net").expect("--net");
        assert_eq!(
            args[net + 1..net + 3],
            [
                "fd=4,mac=02:00:00:00:00:01,id=net0,bw_size=12500000,bw_refill_time=1000",
                "fd=5,mac=02:00:00:00:00:02,id=net1,bw_size=12500000,bw_refill_time=1000",
            ]
        );
        assert!(!args.iter().any(|a| a == "--rate-limit-group"));
    }

    #[test]
    fn firmware_boot_with_volumes_and_two_nics() {
        let image = Some(GuestImage::Firmware(Path::new("/srv/CLOUDHV.fd")));
        let volumes = [
            "/var/lib/eitri/volumes/data-1",
            "/var/lib/eitri/volumes/logs",
        ];

        let args = argv(
            image,
            &files(&volumes),
            &shape(&[nic(4, 1), nic(5, 2)], 1, 128),
        );

        assert_eq!(
            text(args),
            [
                "--api-socket",
                "fd=3",
                "--firmware",
                "/srv/CLOUDHV.fd",
                "--disk",
                "path=/var/lib/eitri/vms/web-1/disk.raw,image_type=raw,backing_files=off",
                "path=/var/lib/eitri/vms/web-1/seed.iso,readonly=on,image_type=raw,backing_files=off",
                "path=/var/lib/eitri/volumes/data-1,image_type=raw,backing_files=off",
                "path=/var/lib/eitri/volumes/logs,image_type=raw,backing_files=off",
                "--net",
                "fd=4,mac=02:00:00:00:00:01,id=net0",
                "fd=5,mac=02:00:00:00:00:02,id=net1",
                "--serial",
                "file=/var/lib/eitri/vms/web-1/serial.log",
                "--console",
                "off",
                "--vsock",
                "cid=3,socket=/run/eitri/0123456789abcdef.vsock/guest.sock",
                "--cpus",
                "boot=1",
                "--memory",
                "size=128M,shared=on",
                "--log-file",
                "/var/lib/eitri/vms/web-1/hypervisor.log",
                "--landlock",
                "--landlock-rules",
                "path=/var/lib/eitri/vms/web-1/snapshot.tmp,access=rw",
            ]
        );
    }

    #[test]
    fn every_disk_is_raw_with_backing_files_off() {
        let volumes = ["/var/lib/eitri/volumes/data-1"];

        let args = text(argv(kernel(), &files(&volumes), &shape(&[], 1, 64)));

        let start = args.iter().position(|a| a == "--disk").expect("--disk");
        let disks: Vec<&String> = args[start + 1..]
            .iter()
            .take_while(|a| !a.starts_with("--"))
            .collect();
        assert_eq!(disks.len(), 3, "{disks:?}");
        for disk in disks {
            assert!(
                disk.ends_with(",image_type=raw,backing_files=off"),
                "{disk}"
            );
        }
    }

    #[test]
    fn a_restore_names_its_snapshot_its_memory_mode_and_each_nics_new_tap() {
        let args = restore_argv(
            Path::new("/var/lib/eitri/vms/web-1/snapshot"),
            MemoryRestore::OnDemand,
            Path::new("/var/lib/eitri/vms/web-1/hypervisor.log"),
            &shape(&[nic(4, 1), nic(5, 2)], 1, 128),
        );

        assert_eq!(
            text(args),
            [
                "--api-socket",
                "fd=3",
                "--restore",
                "source_url=file:///var/lib/eitri/vms/web-1/snapshot,memory_restore_mode=ondemand,net_fds=[net0@[4],net1@[5]]",
                "--log-file",
                "/var/lib/eitri/vms/web-1/hypervisor.log",
            ]
        );
    }

    #[test]
    fn memory_on_huge_pages_names_their_size() {
        let shape = VmShape {
            hugepages: true,
            ..shape(&[], 1, 512)
        };

        let args = text(argv(kernel(), &files(&[]), &shape));

        let memory = args.iter().position(|a| a == "--memory").expect("--memory");
        assert_eq!(
            args[memory + 1],
            "size=512M,shared=on,hugepages=on,hugepage_size=2M,reserve=on"
        );
    }

    #[test]
    fn a_restore_without_nics_or_userfaultfd_copies_and_names_no_taps() {
        let args = text(restore_argv(
            Path::new("/s/vms/a/snapshot"),
            MemoryRestore::Copy,
            Path::new("/s/vms/a/hypervisor.log"),
            &shape(&[], 1, 64),
        ));

        assert_eq!(
            args[3],
            "source_url=file:///s/vms/a/snapshot,memory_restore_mode=copy"
        );
    }

    #[test]
    fn no_nic_means_no_net_flag() {
        let args = text(argv(kernel(), &files(&[]), &shape(&[], 1, 64)));

        assert!(!args.iter().any(|a| a == "--net"), "{args:?}");
    }
}
