//! Each command but `run` and `check` (whose settings are `run.rs`'s):
//! its arguments into a [`Command`], every value checked.

use std::collections::HashMap;
use std::path::PathBuf;

use super::settings::{Key, Section};
use super::{Command, ConfigError, err, flag_values, read, run};

pub(super) fn parse_keygen(rest: &[String]) -> Result<Command, ConfigError> {
    let flags = flag_values(rest, &["id", "out"], &[])?;
    match (flags.get("id"), flags.get("out")) {
        (Some(id), Some(out)) => Ok(Command::Keygen {
            id: (*id).to_owned(),
            out: PathBuf::from(out),
        }),
        _ => Err(err("usage: eitri-agent keygen --id KEY-ID --out KEY-FILE")),
    }
}

/// How long a signed file is obeyed when `sign` is not told: a week.
/// Long enough for a file signed by hand to carry a week of changes; short
/// enough that an old file found later (a backup, a copy in a ticket) is
/// refused rather than obeyed. A control plane signs every answer afresh.
pub(super) const VALID_FOR: &str = "168h";

pub(super) fn parse_sign(rest: &[String]) -> Result<Command, ConfigError> {
    let usage = "usage: eitri-agent sign --key KEY-FILE [--embed] [--valid-for DURATION] FILE";
    let Some((file, flags)) = rest.split_last() else {
        return Err(err(usage));
    };
    let flags = flag_values(flags, &["key", "valid-for"], &["embed"])?;
    let raw = flags.get("valid-for").copied().unwrap_or(VALID_FOR);
    let valid_for = super::parse_duration(raw).ok_or_else(|| {
        err(format!(
            "--valid-for {raw:?} is not a duration: give one with its unit (12h, 168h), or 0 for a file that never expires"
        ))
    })?;
    match flags.get("key") {
        Some(key) if !file.starts_with("--") => Ok(Command::Sign {
            key: PathBuf::from(key),
            file: PathBuf::from(file),
            embed: flags.contains_key("embed"),
            valid_for: (!valid_for.is_zero()).then_some(valid_for),
        }),
        _ => Err(err(usage)),
    }
}

pub(super) fn parse_epoch(
    rest: &[String],
    env: &HashMap<String, String>,
) -> Result<Command, ConfigError> {
    let flags = flag_values(rest, &["state-dir", "set"], &[])?;
    let set = match flags.get("set") {
        None => None,
        Some(n) => Some(n.parse::<u64>().map_err(|_| {
            err(format!(
                "--set {n:?}: not an epoch; give a whole number (0 to 18446744073709551615)"
            ))
        })?),
    };
    Ok(Command::Epoch {
        state_dir: state_dir_of(&flags, env),
        set,
    })
}

pub(super) fn parse_release(
    rest: &[String],
    env: &HashMap<String, String>,
) -> Result<Command, ConfigError> {
    let keys = [Key::AgentsDir, Key::KvmDevice, Key::UserfaultfdDevice];
    let mut known = vec!["state-dir"];
    known.extend(keys.iter().map(|k| k.setting().flag));
    let flags = flag_values(rest, &known, &["force"])?;
    Ok(Command::Release {
        state_dir: state_dir_of(&flags, env),
        agents_dir: path_of(Key::AgentsDir, &flags, env),
        devices: [Key::KvmDevice, Key::UserfaultfdDevice]
            .into_iter()
            .map(|k| path_of(k, &flags, env))
            .filter(|p| !p.as_os_str().is_empty())
            .collect(),
        force: flags.contains_key("force"),
    })
}

pub(super) fn parse_images(
    rest: &[String],
    env: &HashMap<String, String>,
) -> Result<Command, ConfigError> {
    let state_dir = |flags: &[String]| -> Result<PathBuf, ConfigError> {
        let flags = flag_values(flags, &["state-dir"], &[])?;
        Ok(state_dir_of(&flags, env))
    };
    match rest.split_first() {
        Some((sub, flags)) if sub == "prune" => Ok(Command::ImagesPrune {
            state_dir: state_dir(flags)?,
        }),
        Some((sub, flags)) if sub == "list" => Ok(Command::ImagesList {
            state_dir: state_dir(flags)?,
        }),
        _ => Err(err(
            "usage: eitri-agent images list [--state-dir DIR] | images prune [--state-dir DIR]",
        )),
    }
}

/// The VM a command names first, if it names one.
pub(super) fn vm_arg(
    args: &[String],
) -> Result<(Option<crate::model::Id>, &[String]), ConfigError> {
    match args.split_first() {
        Some((first, rest)) if !first.starts_with("--") => crate::model::Id::parse(first)
            .map(|id| (Some(id), rest))
            .map_err(|e| err(format!("VM id {e}"))),
        _ => Ok((None, args)),
    }
}

pub(super) fn parse_status(
    args: &[String],
    env: &HashMap<String, String>,
) -> Result<Command, ConfigError> {
    let (vm_id, args) = vm_arg(args)?;
    let flags = flag_values(args, &["state-dir"], &["json", "watch"])?;
    Ok(Command::Status {
        state_dir: state_dir_of(&flags, env),
        json: flags.contains_key("json"),
        vm_id,
        watch: flags.contains_key("watch"),
    })
}

pub(super) fn parse_logs(
    args: &[String],
    env: &HashMap<String, String>,
) -> Result<Command, ConfigError> {
    let usage =
        "usage: eitri-agent logs VM [--state-dir DIR] [--lines N] [--follow] [--hypervisor]";
    let (Some(vm_id), args) = vm_arg(args)? else {
        return Err(err(usage));
    };
    let flags = flag_values(args, &["state-dir", "lines"], &["follow", "hypervisor"])?;
    Ok(Command::Logs {
        state_dir: state_dir_of(&flags, env),
        vm_id,
        lines: lines_of(&flags, 50)?,
        follow: flags.contains_key("follow"),
        hypervisor: flags.contains_key("hypervisor"),
    })
}

pub(super) fn parse_events(
    args: &[String],
    env: &HashMap<String, String>,
) -> Result<Command, ConfigError> {
    let (vm_id, args) = vm_arg(args)?;
    let flags = flag_values(args, &["state-dir", "lines"], &["follow"])?;
    Ok(Command::Events {
        state_dir: state_dir_of(&flags, env),
        vm_id,
        lines: lines_of(&flags, 20)?,
        follow: flags.contains_key("follow"),
    })
}

pub(super) fn parse_top(
    args: &[String],
    env: &HashMap<String, String>,
) -> Result<Command, ConfigError> {
    let flags = flag_values(args, &["state-dir", "every"], &["once", "json"])?;
    let every = match flags.get("every") {
        None => std::time::Duration::from_secs(2),
        Some(v) => super::parse_duration(v)
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                err(format!(
                    "--every: {v:?} is not a duration above 0 (e.g. 2s)"
                ))
            })?,
    };
    Ok(Command::Top {
        state_dir: state_dir_of(&flags, env),
        once: flags.contains_key("once"),
        json: flags.contains_key("json"),
        every,
    })
}

/// `--lines N`, or `default`.
fn lines_of(flags: &HashMap<String, &str>, default: usize) -> Result<usize, ConfigError> {
    match flags.get("lines") {
        None => Ok(default),
        Some(n) => n
            .parse()
            .map_err(|_| err(format!("--lines: {n:?} is not a number of lines"))),
    }
}

/// `--state-dir` of a command other than `run`, read as `run` reads it:
/// the flag, else its environment variable, else its default.
pub(super) fn state_dir_of(
    flags: &HashMap<String, &str>,
    env: &HashMap<String, String>,
) -> PathBuf {
    path_of(Key::StateDir, flags, env)
}

/// A path setting of `run` given to another command, read as `run` reads
/// it (the flag, else its environment variable, else its default).
pub(super) fn path_of(
    key: Key,
    flags: &HashMap<String, &str>,
    env: &HashMap<String, String>,
) -> PathBuf {
    let setting = key.setting();
    PathBuf::from(
        flags
            .get(setting.flag)
            .map(|s| s.to_string())
            .or_else(|| env.get(setting.env).cloned())
            .unwrap_or_else(|| setting.default.into()),
    )
}

/// `eitri-agent config`: every setting of `run` by section, its value and
/// where the value came from, as `run` would read them with these flags,
/// this environment and this file.
pub(super) fn show_config(
    args: &[String],
    env: &HashMap<String, String>,
) -> Result<Command, ConfigError> {
    let raw = read::Raw::read(args, env)?;
    let mut text =
        String::from("# the settings `eitri-agent run` would use, and where each came from\n");
    match &raw.file_path {
        Some(path) => text.push_str(&format!(
            "# (flag, else env, else the file {}, else default)\n",
            crate::quote::path(path)
        )),
        None => text.push_str("# (flag, else env, else default; no --config file)\n"),
    }
    // Left to their defaults, the ids and cgroup root are the state dir's
    // claim's, not the settings table's: shown as a start would take them.
    let (state_dir, _) = raw.value(Key::StateDir);
    let (claim, claimed) = crate::state::claim::foreseen(
        std::path::Path::new(&state_dir),
        state_dir == Key::StateDir.setting().default,
    );
    for section in Section::ALL {
        text.push_str(&format!("\n[{}]\n", section.name()));
        for key in Key::ALL.iter().filter(|k| k.setting().section == *section) {
            let (value, origin) = raw.value(*key);
            let (value, origin) = match (key, origin) {
                (Key::VmmIds, read::Origin::Default) => {
                    (format!("{}:{}", claim.first_id, claim.id_count), claimed)
                }
                (Key::CgroupRoot, read::Origin::Default) => (claim.cgroup_root.clone(), claimed),
                _ => (value, origin.name()),
            };
            let shown = if value.is_empty() {
                "-".to_owned()
            } else {
                value
            };
            text.push_str(&format!(
                "{:<28} {:<40} {}\n",
                key.setting().flag,
                shown,
                origin
            ));
        }
    }
    let problem = run::build(&raw).err();
    Ok(Command::Config { text, problem })
}
