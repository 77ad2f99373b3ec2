//! The README's own promises: its Quick start run verbatim, and its
//! contents naming every section in order.

#[cfg(target_os = "linux")]
use super::*;

/// The README's Quick start: the shell block between its markers, as it
/// stands.
#[cfg(target_os = "linux")]
fn quick_start() -> String {
    let readme = include_str!("../../README.md");
    let begin = readme
        .find("<!-- quick-start:begin -->")
        .expect("the README marks its Quick start");
    let end = readme
        .find("<!-- quick-start:end -->")
        .expect("the Quick start's end");
    readme[begin..end]
        .lines()
        .skip_while(|l| !l.starts_with("```sh"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .map(|l| format!("{l}\n"))
        .collect()
}

#[cfg(target_os = "linux")]
#[test]
fn quick_start_boots_a_vm_to_ready() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("bin");
    std::os::unix::fs::symlink(BIN, bin.join("eitri-agent")).expect("the agent on PATH");
    // The stand-in, or the real parts when they are given.
    let real = ["EITRI_REAL_CH", "EITRI_REAL_KERNEL", "EITRI_REAL_IMAGE"]
        .map(|v| std::env::var(v).ok().filter(|p| !p.is_empty()));
    let (kernel, image, kvm) = match real {
        [Some(ch), Some(kernel), Some(image)] => {
            std::fs::copy(ch, bin.join("cloud-hypervisor")).expect("cloud-hypervisor");
            (kernel.into(), image.into(), PathBuf::from("/dev/kvm"))
        }
        _ => {
            eitri_agent::testkit::standin_hypervisor(
                Path::new(env!("CARGO_BIN_EXE_eitri-standin-hypervisor")),
                &bin.join("cloud-hypervisor"),
                &[],
            );
            let kernel = dir.path().join("vmlinux");
            std::fs::write(&kernel, b"a kernel").expect("kernel");
            let image = dir.path().join("guest.raw");
            std::fs::write(&image, vec![0x5a; 1 << 20]).expect("image");
            let kvm = dir.path().join("kvm");
            std::fs::write(&kvm, b"").expect("kvm");
            (kernel, image, kvm)
        }
    };
    let script = dir.path().join("quick-start.sh");
    std::fs::write(&script, quick_start()).expect("script");
    let cgroup_root = format!("eitri-test-{}-quick", std::process::id());
    // A host of its own for the run: /srv a tmpfs, a network namespace
    // (the agent's bridge and firewall), a pid namespace (whatever the
    // Quick start leaves running ends with it). The agent and its VMMs are
    // stopped, and the state dir's claim released, before it ends.
    let harness = r#"set -e
ip link set lo up
mount -t tmpfs tmpfs /srv
mkdir /srv/eitri
cp "$KERNEL" /srv/eitri/vmlinux
touch /srv/eitri/guest.raw
mount --bind "$IMAGE" /srv/eitri/guest.raw
timeout 120 bash -e "$SCRIPT"
pkill -TERM -f '[e]itri-agent run' || true
while pgrep -f '[e]itri-agent run' > /dev/null; do sleep 0.1; done
pkill -KILL cloud-hyperviso || true
while pgrep cloud-hyperviso > /dev/null; do sleep 0.1; done
eitri-agent release --state-dir /srv/eitri/state --force
"#;
    let path = |p: &Path| p.display().to_string();

    let out = Command::new("unshare")
        .args([
            "--mount",
            "--net",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
            "bash",
            "-c",
            harness,
        ])
        .env_clear()
        .env(
            "PATH",
            format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", path(&bin)),
        )
        .env("KERNEL", path(&kernel))
        .env("IMAGE", path(&image))
        .env("SCRIPT", path(&script))
        // What the Quick start leaves at its defaults, kept off this host.
        .env("EITRI_KVM_DEVICE", path(&kvm))
        .env("EITRI_USERFAULTFD_DEVICE", "")
        .env("EITRI_CGROUP_ROOT", &cgroup_root)
        .env("EITRI_AGENTS_DIR", path(&dir.path().join("agents")))
        .env("EITRI_RUN_DIR", path(&dir.path().join("run")))
        .output()
        .expect("unshare");
    eitri_agent::testkit::end_cgroup_root(&cgroup_root);

    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("hello-1 "))
        .unwrap_or_default();
    assert!(
        row.contains(" running ") && row.contains(" ready "),
        "{stdout}"
    );
}

#[test]
fn the_readmes_contents_name_every_section_in_order() {
    let readme = include_str!("../../README.md");
    let mut in_code = false;
    let mut headings = Vec::new();
    for line in readme.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code
            && (line.starts_with("## ") || line.starts_with("### "))
            && line != "## Contents"
        {
            headings.push(line.trim_start_matches('#').trim().to_owned());
        }
    }
    let contents: Vec<String> = readme
        .split("## Contents\n")
        .nth(1)
        .unwrap_or_default()
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|l| Some(l.split_once("- [")?.1.split_once("](")?.0.to_owned()))
        .collect();

    assert_eq!(contents, headings);
}
