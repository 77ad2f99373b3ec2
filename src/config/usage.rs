//! The help of every command: `--help`'s synopsis, `run`'s flags by
//! section (made from the settings table), and each other command's.

use super::read;
use super::settings::{Key, Section};

/// The synopsis of every command, the top of `--help`.
const SYNOPSIS: &str = "\
usage: eitri-agent run [--config FILE] [FLAGS]   converge this host and report (the daemon)
       eitri-agent config [--config FILE] [FLAGS]   the settings run would use, and where each came from
       eitri-agent check [--config FILE] [FLAGS]    whether this host has all run needs, one line each
       eitri-agent status [VM] [--state-dir DIR] [--json] [--watch]   the last report, or one VM in detail
       eitri-agent logs VM [--state-dir DIR] [--lines N] [--follow] [--hypervisor]   a VM's console (or its hypervisor's log)
       eitri-agent events [VM] [--state-dir DIR] [--lines N] [--follow]   what happened to a VM (or every VM), one line each
       eitri-agent top [--state-dir DIR] [--once] [--json] [--every DURATION]   what each running VM uses, redrawn
       eitri-agent images list|prune [--state-dir DIR]   the cached images and their VMs, or delete those no VM uses
       eitri-agent release [--state-dir DIR] [--agents-dir DIR] [--force]   end a state dir's claim on the host
       eitri-agent epoch [--state-dir DIR] [--set N]   the epoch fence a stopped agent holds, or move it
       eitri-agent keygen --id KEY-ID --out KEY-FILE  make a key that signs desired state; prints its public line
       eitri-agent sign --key KEY-FILE [--embed] FILE   sign a desired file: FILE.sig beside it, or its first line
       eitri-agent host-key [--state-dir DIR]         the key this host signs its reports with, to pin
       eitri-agent --version | --help
       eitri-agent COMMAND --help         one command's flags (run --help-all: in full)
";

/// The `--help` text: every command, then `run`'s flags by section,
/// generated from the settings table.
pub fn usage() -> String {
    let mut out = String::from(SYNOPSIS);
    out.push_str(
        "\nThe host agent of the eitri microVM platform. Give --desired FILE (standalone)\n\
         or --control-plane URL. A setting is taken from its flag, else its environment\n\
         variable, else the config file (--config FILE, $EITRI_CONFIG), else its default.\n\n",
    );
    out.push_str(&run_usage(false));
    out
}

/// `run --help` (`all`: `--help-all`): its flags section by section; in
/// full, each with its default, environment variable and config-file key.
pub(super) fn run_usage(all: bool) -> String {
    let mut out = String::from(if all {
        "Flags of `run`, by section (default in brackets):\n"
    } else {
        "Flags of `run`, by section (run --help-all: each in full, with its default,\n\
         environment variable and config-file key):\n"
    });
    for section in Section::ALL {
        let (title, about) = section.title();
        out.push_str(&format!("\n{title}: {about}\n"));
        for s in Key::ALL
            .iter()
            .map(|k| k.setting())
            .filter(|s| s.section == *section)
        {
            if all {
                out.push_str(&flag_line(s.flag, s.help, s.default, Some(s.env)));
                out.push_str(&format!(
                    "  {:<26} file: {}.{}\n",
                    "",
                    section.name(),
                    s.flag
                ));
            } else {
                out.push_str(&format!("  --{:<26} {}\n", s.flag, s.help));
            }
        }
    }
    out.push_str(&format!(
        "\n  --{:<26} {}\n",
        read::CONFIG_FLAG,
        "a JSON file of these settings by section, e.g. {\"hypervisor\": {\"kernel\": \"/boot/vmlinux\"}} (or $EITRI_CONFIG)"
    ));
    out.push_str("\nDurations take a unit: 500ms, 30s, 15m, 24h.\n");
    out
}

/// One flag of `--help`: the flag and what it does, then its default and
/// its environment variable, if it has one.
pub(super) fn flag_line(flag: &str, help: &str, default: &str, env: Option<&str>) -> String {
    let default = if default.is_empty() { "none" } else { default };
    let env = env.map(|e| format!(" ${e}")).unwrap_or_default();
    format!("  --{flag:<24} {help}\n  {:<26} [{default}]{env}\n", "")
}

pub(super) fn check_usage() -> String {
    format!(
        "usage: eitri-agent check [--config FILE] [FLAGS]\n\n\
         Checks, all at once, what `run` with these settings needs of this host: the\n\
         hypervisor and its version, the boot file, /dev/kvm, /dev/net/tun, the\n\
         userfaultfd device, root, cgroups, Landlock, ip and nft, the image root,\n\
         room in the state dir. One line each: ok, warn (it runs, with less) or\n\
         FAIL (no VM can be created), with what was found or what to do. Exits 1\n\
         when a check fails, 2 when the settings are refused; changes nothing. The\n\
         agent runs the same checks when it starts, and logs what is not ok. It\n\
         takes every flag of `run`.\n\n{}",
        run_usage(false)
    )
}

pub(super) fn config_usage() -> String {
    format!(
        "usage: eitri-agent config [--config FILE] [FLAGS]\n\n\
         The settings `run` would use with these flags, this environment and this\n\
         file, section by section, and where each came from (flag, env, file or\n\
         default); then whether `run` would accept them. It takes every flag of\n\
         `run`.\n\n{}",
        run_usage(false)
    )
}

/// The help of a command that reads the state dir: its synopsis, then its
/// flags (`--state-dir` first, as `run` has it).
pub(super) fn verb_usage(synopsis: &str, flags: &[(&str, &str)]) -> String {
    let dir = Key::StateDir.setting();
    let mut out = format!("usage: eitri-agent {synopsis}\n\nFlags:\n");
    out.push_str(&flag_line(dir.flag, dir.help, dir.default, Some(dir.env)));
    // A verb's own flags have no default, environment variable or file
    // key to show: their line alone (a "[none]" under each read as if
    // they were settings left empty).
    for (flag, help) in flags {
        out.push_str(&format!("  --{flag:<24} {help}\n"));
    }
    out
}

pub(super) fn status_usage() -> String {
    verb_usage(
        "status [VM] [--state-dir DIR] [--json] [--watch]\n\n\
         The last report the agent wrote, or VM in detail. Reads the state dir\n\
         without its lock: works beside a running agent.",
        &[
            ("json", "the report as JSON, as the agent wrote it"),
            ("watch", "redraw every tick of the agent"),
        ],
    )
}

pub(super) fn logs_usage() -> String {
    verb_usage(
        "logs VM [--state-dir DIR] [--lines N] [--follow] [--hypervisor]\n\n\
         A VM's serial console, or its hypervisor's own log.",
        &[
            ("lines N", "how many of the last lines to print [50]"),
            ("follow", "keep printing what is added"),
            ("hypervisor", "the hypervisor's log instead of the console"),
        ],
    )
}

pub(super) fn events_usage() -> String {
    verb_usage(
        "events [VM] [--state-dir DIR] [--lines N] [--follow]\n\n\
         What happened to VM, or to every VM of the state dir in time order:\n\
         one line per event, its time (UTC), its type (Normal or Warning), its\n\
         reason (Created, Cloned, Booted, Rebooted, HypervisorExited, Unhealthy,\n\
         Suspended, Woken, Quarantined, Destroyed, ...; Other where none fits),\n\
         the VM and what the agent said. Each VM keeps up to its last 32 KiB.\n\
         Reads the state dir without its lock: works beside a running agent.",
        &[
            ("lines N", "how many of the last events to print [20]"),
            ("follow", "keep printing events as they happen"),
        ],
    )
}

pub(super) fn top_usage() -> String {
    verb_usage(
        "top [--state-dir DIR] [--once] [--json] [--every DURATION]\n\n\
         What each running VM uses, one row each, busiest CPU first: CPU (% of\n\
         one core), its hypervisor's resident memory, disk reads and writes\n\
         (bytes and requests a second) and network in and out (bytes a second,\n\
         from the guest's side). The agent samples them every --usage-interval\n\
         (10s unless set), each a rate over the last interval; a VM started since\n\
         its last sample shows - until its second. Reads report.json without the\n\
         state dir's lock: works beside a running agent.",
        &[
            ("once", "print the rows once, not redrawn"),
            ("json", "the figures as JSON, by VM id (once)"),
            ("every DURATION", "how often the rows are drawn again [2s]"),
        ],
    )
}

pub(super) fn images_usage() -> String {
    verb_usage(
        "images list [--state-dir DIR] | images prune [--state-dir DIR]\n\n\
         list: each cached base image, its size, what it holds of the disk, how\n\
         long ago it was cached and which VMs name it; it reads, so it works\n\
         beside a running agent. prune: deletes cached base images no VM record\n\
         names and the last desired state does not, beside a running agent or\n\
         not: it waits (at most 30 s) for the VMs being created to make their\n\
         root disks. A running agent also prunes by itself with --image-cache-max.",
        &[],
    )
}

pub(super) fn host_key_usage() -> String {
    verb_usage(
        "host-key [--state-dir DIR]\n\n\
         Prints the line a control plane pins to check this host's reports\n\
         (`ed25519 KEY-ID BASE64`): an agent with --trusted-keys signs each report\n\
         it sends with this key, kept secret in the state dir. The key is made\n\
         the first time it is asked for, here or by the agent, and kept.",
        &[],
    )
}

pub(super) fn keygen_usage() -> String {
    verb_usage(
        "keygen --id KEY-ID --out KEY-FILE\n\n\
         Makes an ed25519 key for signing desired state: its secret is written to\n\
         KEY-FILE (0600, never over an existing file), and the line each host pins\n\
         in its --trusted-keys file is printed.",
        &[
            (
                "id",
                "the key's name, as hosts pin it and signatures carry it",
            ),
            ("out", "where the secret key is written"),
        ],
    )
}

pub(super) fn sign_usage() -> String {
    verb_usage(
        "sign --key KEY-FILE [--embed] [--valid-for DURATION] FILE\n\n\
         Signs a desired-state file with the secret key from `keygen`, writing\n\
         FILE.sig beside it, or with --embed, into FILE itself (its first line),\n\
         replaced in one rename: an agent never reads the file with a signature\n\
         that is not its own. The file must name the host it is for (`host_id`):\n\
         a host refuses a signed snapshot that names no host or another, so that\n\
         one host's cannot be replayed to another. The file is obeyed until its\n\
         `not_after_unix_ms`, which sign sets (or replaces) before signing.",
        &[
            ("key", "the secret key file `keygen` wrote"),
            (
                "embed",
                "the signature as FILE's own first line (signing again replaces it)",
            ),
            (
                "valid-for",
                "how long from now the file is obeyed [168h: a week]; 0: it keeps the expiry it has, or none (an epoch_reset then is refused)",
            ),
        ],
    )
}

pub(super) fn epoch_usage() -> String {
    verb_usage(
        "epoch [--state-dir DIR] [--set N]\n\n\
         Prints the epoch fence the state dir holds: the highest epoch of desired\n\
         state its agent accepted, below which a control plane's snapshots are\n\
         refused as stale. With --set, moves it to N: the way back when an answer\n\
         the agent should not have trusted (unsigned, without --trusted-keys)\n\
         raised it past the real control plane's. Refused while the agent runs (it\n\
         takes the state dir's lock); the agent accepts epoch N or later once\n\
         started again.",
        &[("set", "the epoch to move the fence to")],
    )
}

pub(super) fn release_usage() -> String {
    let [agents, kvm, userfaultfd] =
        [Key::AgentsDir, Key::KvmDevice, Key::UserfaultfdDevice].map(|k| k.setting());
    verb_usage(
        "release [--state-dir DIR] [--agents-dir DIR] [--kvm-device PATH] [--force]\n\n\
         Ends the state dir's claim on this host: takes its VMM group off the\n\
         devices' ACLs, removes its cgroup roots, frees its VMM ids and removes its\n\
         record from the agents' registry. Refused while its agent runs (it takes\n\
         the state dir's lock), while processes are in its cgroups, and while it has\n\
         VMs or volumes. The state dir itself is kept; an agent started on it again\n\
         claims anew. A state dir that is deleted needs none of this: the next\n\
         agent to start on the host takes its claim back.",
        &[
            (agents.flag, agents.help),
            (kvm.flag, kvm.help),
            (userfaultfd.flag, userfaultfd.help),
            (
                "force",
                "release it with VMs or volumes left in it (their files stay; they are said)",
            ),
        ],
    )
}
