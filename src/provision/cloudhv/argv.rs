//! The VMM's command line: a pure function of what the VM is, how guests
//! boot, and where the VM's files are. Nothing here touches the host, so
//! every shape of it is tested as golden output, without root.
//!
//! The flags are cloud-hypervisor's own (v51 and later, as its `--help`
//! names them):
//! the API socket as an inherited listening fd (the agent binds it, so the
//! jailed VMM creates nothing in the run dir), the guest's kernel or
//! firmware, the disks (root, then the seed read-only, then the volumes in
//! the spec's order), one `--net` per NIC as an inherited tap fd, serial
//! output to a file and the virtio console off (it would be the agent's
//! tty), CPUs, memory, the VMM's own log, and Landlock when the host has
//! it (the VMM then confines itself to the files this command line names).
//!
//! The root disk's argument, `path=<state>/vms/<id>/disk.raw,…`, is also
//! how the agent knows a VM's VMM by its command line.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::model::Mac;

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
}

/// A NIC as the VMM is given it: a tap fd it inherits, and the guest MAC.
#[derive(Clone, Copy, Debug)]
pub struct Nic {
    pub fd: i32,
    pub mac: Mac,
}

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
    pub landlock: bool,
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
    arg("--disk".into());
    arg(option("path=", &files.root_disk, RAW));
    arg(option("path=", &files.seed, &format!(",readonly=on{RAW}")));
    for volume in &files.volumes {
        arg(option("path=", volume, RAW));
    }
    if !shape.nics.is_empty() {
        arg("--net".into());
        for nic in shape.nics {
            arg(format!("fd={},mac={}", nic.fd, nic.mac).into());
        }
    }
    arg("--serial".into());
    arg(option("file=", &files.serial_log, ""));
    arg("--console".into());
    arg("off".into());
    arg("--cpus".into());
    arg(format!("boot={}", shape.vcpus).into());
    arg("--memory".into());
    arg(format!("size={}M", shape.mem_mb).into());
    arg("--log-file".into());
    arg(files.log.clone().into_os_string());
    if shape.landlock {
        arg("--landlock".into());
    }
    args
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
            landlock: true,
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
                "fd=4,mac=02:00:00:00:00:01",
                "--serial",
                "file=/var/lib/eitri/vms/web-1/serial.log",
                "--console",
                "off",
                "--cpus",
                "boot=2",
                "--memory",
                "size=512M",
                "--log-file",
                "/var/lib/eitri/vms/web-1/hypervisor.log",
                "--landlock",
            ]
        );
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
                "fd=4,mac=02:00:00:00:00:01",
                "fd=5,mac=02:00:00:00:00:02",
                "--serial",
                "file=/var/lib/eitri/vms/web-1/serial.log",
                "--console",
                "off",
                "--cpus",
                "boot=1",
                "--memory",
                "size=128M",
                "--log-file",
                "/var/lib/eitri/vms/web-1/hypervisor.log",
                "--landlock",
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
    fn no_nic_means_no_net_flag() {
        let args = text(argv(kernel(), &files(&[]), &shape(&[], 1, 64)));

        assert!(!args.iter().any(|a| a == "--net"), "{args:?}");
    }
}
