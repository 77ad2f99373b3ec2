//! The systemd unit's `ExecStart`, run as systemd would run it: its words
//! expanded by systemd's rules first, then the shell. No host here runs
//! systemd as pid 1, so the unit's start is proved in two halves: what
//! systemd hands the shell (ported below from systemd's `replace_env`),
//! and what the shell then exports for the agent.

use std::collections::HashMap;
use std::path::Path;

use eitri_agent::testkit::tools::{require, tool};

/// The unit file as shipped.
fn unit() -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/systemd/eitri-agent.service"),
    )
    .expect("unit")
}

/// The one argument the unit's `ExecStart` gives `/bin/sh -c`, as written.
fn exec_start(unit: &str) -> String {
    unit.lines()
        .find_map(|l| l.strip_prefix("ExecStart=/bin/sh -c '"))
        .and_then(|l| l.strip_suffix('\''))
        .expect("the unit's ExecStart")
        .to_owned()
}

/// What systemd makes of a word of a command that is not a lone `$NAME`
/// (`replace_env` with no flags, as `replace_env_argv` calls it): `$$` is
/// `$`; `${NAME}` is the unit's variable NAME, or nothing when it has none;
/// a `:` inside the braces leaves the whole construct as written; `$NAME`
/// without braces is left alone.
fn systemd_expands(word: &str, env: &HashMap<&str, &str>) -> String {
    let mut out = String::new();
    let mut rest = word;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('{')
            && let Some(end) = inner.find(['}', ':'])
            && inner.as_bytes()[end] == b'}'
        {
            out.push_str(env.get(&inner[..end]).copied().unwrap_or(""));
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The unit's start over `env_dir`, as the shell gets it from systemd, with
/// `cgroup` in place of `/proc/self/cgroup`, `state_dir` in place of the
/// default state dir, and `env` run in place of the agent: the `EITRI_*`
/// variables the agent would start with.
fn started(env_dir: &Path, cgroup: &Path, state_dir: &Path) -> Vec<String> {
    let unit = unit();
    // The unit sets no variable of its own but PATH.
    let script = systemd_expands(&exec_start(&unit), &HashMap::from([("PATH", "/usr/bin")]))
        .replace("/etc/eitri/env", &env_dir.display().to_string())
        .replace("/proc/self/cgroup", &cgroup.display().to_string())
        .replace("/var/lib/eitri", &state_dir.display().to_string())
        .replace("exec eitri-agent run", "exec env");
    eitri_env(std::process::Command::new("/bin/sh").args(["-c", &script]))
}

/// What the environment holds of `EITRI_*` after `command` reads the env
/// dir, printed by `env`.
fn eitri_env(command: &mut std::process::Command) -> Vec<String> {
    let out = command
        .env_clear()
        .env("EITRI_PRESET", "from-before")
        .output()
        .expect("run");
    assert!(out.status.success(), "{out:?}");
    let mut vars: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("EITRI_"))
        .map(str::to_owned)
        .collect();
    vars.sort();
    vars
}

/// An env dir with one value and one emptied variable, and the files the
/// start reads in place of the host's.
struct Host {
    dir: tempfile::TempDir,
}

impl Host {
    fn new(cgroup: &str) -> Host {
        let dir = tempfile::tempdir().expect("tempdir");
        let env = dir.path().join("env");
        std::fs::create_dir(&env).expect("env dir");
        std::fs::write(env.join("EITRI_KERNEL"), "/srv/eitri/vmlinux\nignored\n").expect("env");
        std::fs::write(env.join("EITRI_PRESET"), "").expect("env");
        std::fs::write(dir.path().join("cgroup"), cgroup).expect("cgroup");
        std::fs::create_dir(dir.path().join("state")).expect("state dir");
        Host { dir }
    }

    fn env(&self) -> std::path::PathBuf {
        self.dir.path().join("env")
    }

    fn started(&self) -> Vec<String> {
        let d = self.dir.path();
        started(&self.env(), &d.join("cgroup"), &d.join("state"))
    }
}

#[test]
fn the_units_env_dir_means_what_s6_envdir_means() {
    require("s6-envdir");
    let host = Host::new("0::/\n");

    let systemd = host.started();
    let s6 = eitri_env(tool("s6-envdir").arg(host.env()).arg("env"));

    assert_eq!(systemd, vec!["EITRI_KERNEL=/srv/eitri/vmlinux".to_owned()]);
    assert_eq!(systemd, s6);
}

#[test]
fn systemd_would_hand_the_shell_the_env_loop_whole() {
    // The unit as systemd 252 to 257 read it: a `${...}` meant for the
    // shell but written with one `$` is systemd's variable, gone before the
    // shell runs (the first version of this unit lost `${f##*/}` so).
    let script = systemd_expands(&exec_start(&unit()), &HashMap::new());

    assert!(script.contains(r#"n=${f##*/};"#), "{script}");
    assert!(script.contains(r#"${cg%/agent}/vms"#), "{script}");
}

#[test]
fn a_new_state_dir_under_the_unit_takes_the_cgroups_systemd_delegates() {
    let host = Host::new("0::/system.slice/eitri-agent.service/agent\n");

    let vars = host.started();

    assert!(
        vars.contains(&"EITRI_CGROUP_ROOT=system.slice/eitri-agent.service/vms".to_owned()),
        "{vars:?}"
    );
}

#[test]
fn a_state_dir_with_a_claim_keeps_its_cgroup_root_under_the_unit() {
    let host = Host::new("0::/system.slice/eitri-agent.service/agent\n");
    let jail = host.dir.path().join("state/jail");
    std::fs::create_dir(&jail).expect("jail");
    std::fs::write(jail.join("claim.json"), "{}").expect("claim");

    let vars = host.started();

    assert_eq!(vars, vec!["EITRI_KERNEL=/srv/eitri/vmlinux".to_owned()]);
}

#[test]
fn the_env_dirs_cgroup_root_wins_under_the_unit() {
    let host = Host::new("0::/system.slice/eitri-agent.service/agent\n");
    std::fs::write(host.env().join("EITRI_CGROUP_ROOT"), "machine/eitri\n").expect("env");

    let vars = host.started();

    assert!(
        vars.contains(&"EITRI_CGROUP_ROOT=machine/eitri".to_owned()),
        "{vars:?}"
    );
}

#[test]
fn without_a_delegated_subgroup_the_cgroup_root_is_left_to_its_default() {
    // systemd before 254 starts the agent in the unit's own cgroup.
    let host = Host::new("0::/system.slice/eitri-agent.service\n");

    let vars = host.started();

    assert_eq!(vars, vec!["EITRI_KERNEL=/srv/eitri/vmlinux".to_owned()]);
}
