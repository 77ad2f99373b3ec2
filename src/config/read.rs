//! Reading `run`'s raw settings: each value from its flag, else its
//! environment variable, else the config file, else its default, where it
//! came from, and through which section's reader ([`Part`]) it was read.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use super::file::FileSettings;
use super::settings::{Key, Section};
use super::{ConfigError, err, flag_values, parse_duration};
use crate::model::{Cidr, IpRange};

/// Where a setting's value came from; the later in this list wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Default,
    File,
    Env,
    Flag,
}

impl Origin {
    pub fn name(self) -> &'static str {
        match self {
            Origin::Default => "default",
            Origin::File => "file",
            Origin::Env => "env",
            Origin::Flag => "flag",
        }
    }
}

/// The flag (and variable) naming the config file: not a setting of the
/// table, since a file cannot name itself.
pub(super) const CONFIG_FLAG: &str = "config";
pub(super) const CONFIG_ENV: &str = "EITRI_CONFIG";

/// Raw values of `run`'s settings: flag, else environment, else the
/// config file, else default.
pub(super) struct Raw<'a> {
    pub(super) flags: HashMap<String, &'a str>,
    pub(super) env: &'a HashMap<String, String>,
    pub(super) file: FileSettings,
    /// The config file, if one was named.
    pub file_path: Option<PathBuf>,
    /// Settings a section's builder read although they are another
    /// section's: none, or a test fails (see the tests below).
    pub(super) strays: RefCell<Vec<(Section, Key)>>,
}

impl<'a> Raw<'a> {
    /// The flags in `args`, the environment, and the config file they name.
    pub(super) fn read(
        args: &'a [String],
        env: &'a HashMap<String, String>,
    ) -> Result<Raw<'a>, ConfigError> {
        let mut known: Vec<&str> = Key::ALL.iter().map(|k| k.setting().flag).collect();
        known.push(CONFIG_FLAG);
        let mut flags = flag_values(args, &known, &[])?;
        let file_path = flags
            .remove(CONFIG_FLAG)
            .map(str::to_owned)
            .or_else(|| env.get(CONFIG_ENV).cloned())
            .filter(|p| !p.trim().is_empty())
            .map(PathBuf::from);
        let file = match &file_path {
            Some(path) => FileSettings::read(path)?,
            None => FileSettings::default(),
        };
        Ok(Raw {
            flags,
            env,
            file,
            file_path,
            strays: RefCell::new(Vec::new()),
        })
    }

    /// `key`'s value and where it came from.
    pub(super) fn value(&self, key: Key) -> (String, Origin) {
        let setting = key.setting();
        if let Some(v) = self.flags.get(setting.flag) {
            ((*v).to_owned(), Origin::Flag)
        } else if let Some(v) = self.env.get(setting.env) {
            (v.clone(), Origin::Env)
        } else if let Some(v) = self.file.values.get(&key) {
            (v.clone(), Origin::File)
        } else {
            (setting.default.to_owned(), Origin::Default)
        }
    }

    /// The reader of one section's settings.
    pub(super) fn section(&self, section: Section) -> Part<'_> {
        Part { raw: self, section }
    }

    #[cfg(test)]
    pub(super) fn strays(&self) -> Vec<(Section, Key)> {
        self.strays.borrow().clone()
    }
}

/// One section's settings, as its builder reads them. A read of another
/// section's key is answered (the agent must not fail over its own
/// wiring) and noted, for the test that keeps each section read in one
/// place.
pub(super) struct Part<'r> {
    raw: &'r Raw<'r>,
    section: Section,
}

impl Part<'_> {
    pub(super) fn get(&self, key: Key) -> String {
        self.note(key);
        self.raw.value(key).0
    }

    pub(super) fn note(&self, key: Key) {
        if key.setting().section != self.section {
            self.raw.strays.borrow_mut().push((self.section, key));
        }
    }

    /// Whether the operator set `key` (by flag, environment or file).
    pub(super) fn given(&self, key: Key) -> bool {
        self.note(key);
        self.raw.value(key).1 != Origin::Default
    }

    /// The value, `None` when it is empty or blank.
    pub(super) fn optional(&self, key: Key) -> Option<String> {
        Some(self.get(key)).filter(|v| !v.trim().is_empty())
    }

    /// A path setting, made absolute (see [`absolute`]).
    pub(super) fn path(&self, key: Key) -> PathBuf {
        absolute(self.get(key))
    }

    pub(super) fn optional_path(&self, key: Key) -> Option<PathBuf> {
        self.optional(key).map(absolute)
    }

    pub(super) fn duration(&self, key: Key) -> Result<Duration, ConfigError> {
        let raw = self.get(key);
        parse_duration(&raw).ok_or_else(|| {
            err(format!(
                "--{}: {raw:?} is not a duration; write a number with a unit, e.g. 500ms, 30s, 15m, 24h",
                key.setting().flag
            ))
        })
    }

    pub(super) fn yes_no(&self, key: Key) -> Result<bool, ConfigError> {
        match self.get(key).trim() {
            "yes" | "true" => Ok(true),
            "no" | "false" => Ok(false),
            other => Err(err(format!(
                "--{}: {other:?} is neither yes nor no",
                key.setting().flag
            ))),
        }
    }

    pub(super) fn number(&self, key: Key) -> Result<u64, ConfigError> {
        let raw = self.get(key);
        raw.trim().parse().map_err(|_| {
            err(format!(
                "--{}: {raw:?} is not a whole number",
                key.setting().flag
            ))
        })
    }

    /// A comma-separated list of IPv4 ranges.
    pub(super) fn ranges(&self, key: Key) -> Result<Vec<Cidr>, ConfigError> {
        Cidr::parse_list(&self.get(key)).map_err(|e| err(format!("--{}: {e}", key.setting().flag)))
    }

    /// IPv4 and IPv6 ranges alike.
    pub(super) fn ip_ranges(&self, key: Key) -> Result<Vec<IpRange>, ConfigError> {
        IpRange::parse_list(&self.get(key))
            .map_err(|e| err(format!("--{}: {e}", key.setting().flag)))
    }
}

/// A directory the VMM is told about as `path=…` in an option list, which
/// cloud-hypervisor splits on commas.
pub(super) fn no_comma(key: Key, path: &str) -> Result<(), ConfigError> {
    if path.contains(',') {
        return Err(err(format!(
            "--{}: {path:?} has a comma, which cloud-hypervisor reads as the end of a path; choose a directory without one",
            key.setting().flag
        )));
    }
    Ok(())
}

/// `path` from the agent's working directory when relative, so every
/// path flag means the same whatever reads it later: a hypervisor in its
/// own mount namespace, a child in another directory.
pub(super) fn absolute(path: String) -> PathBuf {
    std::path::absolute(&path).unwrap_or_else(|_| PathBuf::from(path))
}

/// A program: a bare name is found on `PATH` as it is; a path is made
/// absolute like any other.
pub(super) fn program(name: String) -> PathBuf {
    if name.contains('/') {
        absolute(name)
    } else {
        PathBuf::from(name)
    }
}
