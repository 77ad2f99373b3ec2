//! vfkit's command line, built by a pure function from the VM's files and
//! shape (golden-tested below).
//!
//! `--device` values are split on `,` with no escaping, so a path with a
//! comma cannot be passed: it is refused, naming the path. A unix socket
//! path is at most 103 bytes on macOS (`sun_path` is 104 with its NUL).

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::model::Mac;

/// The longest unix socket path macOS can bind.
pub const MAX_SOCKET_PATH: usize = 103;

/// Where a VM's files are.
#[derive(Debug, Clone)]
pub struct Files {
    pub root_disk: PathBuf,
    pub seed: PathBuf,
    pub volumes: Vec<PathBuf>,
    /// The EFI variable store (made by vfkit on the first boot).
    pub efi_vars: PathBuf,
    /// The guest's serial console, as vfkit writes it.
    pub console_log: PathBuf,
    /// The REST API socket.
    pub socket: PathBuf,
    pub pidfile: PathBuf,
}

/// What the VM is.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub cpus: u32,
    pub mem_mib: u64,
    pub mac: Mac,
    /// Whether the EFI variable store exists: `,create` only when it does
    /// not, since vfkit overwrites it on every boot otherwise.
    pub efi_vars_exist: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgvError {
    Comma { path: PathBuf },
    NotUtf8 { path: PathBuf },
    SocketTooLong { path: PathBuf, bytes: usize },
}

impl fmt::Display for ArgvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgvError::Comma { path } => write!(
                f,
                "{} has a comma, which vfkit's --device cannot carry (it splits on commas, with no escaping); choose a state dir without one",
                path.display()
            ),
            ArgvError::NotUtf8 { path } => write!(
                f,
                "{} is not UTF-8, which vfkit's command line cannot carry",
                path.display()
            ),
            ArgvError::SocketTooLong { path, bytes } => write!(
                f,
                "the API socket path {} is {bytes} bytes, over macOS's {MAX_SOCKET_PATH}; use a shorter --run-dir",
                path.display()
            ),
        }
    }
}

impl std::error::Error for ArgvError {}

impl crate::error::Failure for ArgvError {
    /// The paths come from the flags: they stay wrong until changed.
    fn is_permanent(&self) -> bool {
        true
    }
}

/// A path as it can sit inside a `--device` value.
fn device_path(path: &Path) -> Result<&str, ArgvError> {
    let text = path.to_str().ok_or_else(|| ArgvError::NotUtf8 {
        path: path.to_path_buf(),
    })?;
    if text.contains(',') {
        return Err(ArgvError::Comma {
            path: path.to_path_buf(),
        });
    }
    Ok(text)
}

/// vfkit's arguments for the VM (the program itself not included).
pub fn argv(files: &Files, shape: &Shape) -> Result<Vec<OsString>, ArgvError> {
    let socket = device_path(&files.socket)?;
    if socket.len() > MAX_SOCKET_PATH {
        return Err(ArgvError::SocketTooLong {
            path: files.socket.clone(),
            bytes: socket.len(),
        });
    }
    let efi = device_path(&files.efi_vars)?;
    let create = if shape.efi_vars_exist { "" } else { ",create" };
    let mut args: Vec<String> = vec![
        "--cpus".into(),
        shape.cpus.to_string(),
        "--memory".into(),
        shape.mem_mib.to_string(),
        "--bootloader".into(),
        format!("efi,variable-store={efi}{create}"),
        "--device".into(),
        format!("virtio-blk,path={}", device_path(&files.root_disk)?),
        "--device".into(),
        format!("virtio-blk,path={},readonly", device_path(&files.seed)?),
    ];
    for volume in &files.volumes {
        args.push("--device".into());
        args.push(format!("virtio-blk,path={}", device_path(volume)?));
    }
    args.extend([
        "--device".into(),
        format!("virtio-net,nat,mac={}", shape.mac),
        "--device".into(),
        format!(
            "virtio-serial,logFilePath={}",
            device_path(&files.console_log)?
        ),
        "--device".into(),
        "virtio-rng".into(),
        "--restful-uri".into(),
        format!("unix://{socket}"),
        "--pidfile".into(),
        files
            .pidfile
            .to_str()
            .map(str::to_owned)
            .ok_or_else(|| ArgvError::NotUtf8 {
                path: files.pidfile.clone(),
            })?,
        "--log-level".into(),
        "info".into(),
    ]);
    Ok(args.into_iter().map(OsString::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &str) -> Files {
        let d = PathBuf::from(dir);
        Files {
            root_disk: d.join("disk.raw"),
            seed: d.join("seed.iso"),
            volumes: Vec::new(),
            efi_vars: d.join("efi-vars"),
            console_log: d.join("serial.log"),
            socket: PathBuf::from("/var/run/eitri/0123456789abcdef.sock"),
            pidfile: d.join("vfkit.pid"),
        }
    }

    fn shape(efi_vars_exist: bool) -> Shape {
        Shape {
            cpus: 2,
            mem_mib: 1024,
            mac: Mac::parse("02:e1:00:00:00:07").expect("mac"),
            efi_vars_exist,
        }
    }

    fn line(args: &[OsString]) -> String {
        args.iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn a_first_boot_creates_the_efi_store() {
        let args = argv(&files("/s/vms/a"), &shape(false)).expect("argv");

        assert_eq!(
            line(&args),
            "--cpus 2 --memory 1024 \
             --bootloader efi,variable-store=/s/vms/a/efi-vars,create \
             --device virtio-blk,path=/s/vms/a/disk.raw \
             --device virtio-blk,path=/s/vms/a/seed.iso,readonly \
             --device virtio-net,nat,mac=02:e1:00:00:00:07 \
             --device virtio-serial,logFilePath=/s/vms/a/serial.log \
             --device virtio-rng \
             --restful-uri unix:///var/run/eitri/0123456789abcdef.sock \
             --pidfile /s/vms/a/vfkit.pid --log-level info"
        );
    }

    #[test]
    fn a_later_boot_keeps_the_efi_store() {
        let args = argv(&files("/s/vms/a"), &shape(true)).expect("argv");

        assert!(
            line(&args).contains("--bootloader efi,variable-store=/s/vms/a/efi-vars --device"),
            "{}",
            line(&args)
        );
    }

    #[test]
    fn volumes_follow_the_seed_in_order() {
        let mut f = files("/s/vms/a");
        f.volumes = vec![
            PathBuf::from("/s/volumes/v1"),
            PathBuf::from("/s/volumes/v2"),
        ];

        let args = argv(&f, &shape(true)).expect("argv");

        assert!(line(&args).contains(
            "seed.iso,readonly --device virtio-blk,path=/s/volumes/v1 --device virtio-blk,path=/s/volumes/v2 --device virtio-net"
        ));
    }

    #[test]
    fn a_path_with_a_comma_is_refused_naming_it() {
        let err = argv(&files("/s/vms/a,b"), &shape(true)).expect_err("comma");

        assert!(matches!(&err, ArgvError::Comma { path } if path.ends_with("efi-vars")));
        assert!(err.to_string().contains("/s/vms/a,b"), "{err}");
    }

    #[test]
    fn a_socket_path_over_103_bytes_is_refused() {
        let mut f = files("/s/vms/a");
        f.socket = PathBuf::from(format!("/{}.sock", "r".repeat(98)));

        let err = argv(&f, &shape(true)).expect_err("too long");

        assert_eq!(
            err,
            ArgvError::SocketTooLong {
                path: f.socket.clone(),
                bytes: 104
            }
        );
    }

    #[test]
    fn a_socket_path_of_103_bytes_is_taken() {
        let mut f = files("/s/vms/a");
        f.socket = PathBuf::from(format!("/{}.sock", "r".repeat(97)));

        assert!(argv(&f, &shape(true)).is_ok());
    }
}
