//! The config file (`--config FILE`): the settings of `run` as JSON, one
//! object per section, each setting under its flag's name:
//!
//! ```json
//! {
//!   "source": { "control-plane": "http://cp.internal:8080" },
//!   "hypervisor": { "kernel": "/var/lib/eitri/vmlinux" },
//!   "network": { "guest-deny": ["10.0.0.0/8", "192.168.0.0/16"] }
//! }
//! ```
//!
//! JSON because the agent already reads it (serde_json is on the card):
//! TOML or YAML would add a parser to a static binary for the comfort of
//! comments. A value is a string, a number, a boolean, or (for the
//! settings that take a comma-separated list) an array of strings; each is
//! read as the flag's text would be and checked by the same code. A key
//! the table does not know, a setting in the wrong section, or one given
//! twice is refused, naming its line: a typo must not silently leave a
//! default in force.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::de::{self, DeserializeSeed, MapAccess, Visitor};

use super::settings::{Key, Section};
use super::{ConfigError, err};

/// The most a config file may be: its settings are a few kilobytes.
const MAX_BYTES: u64 = 1 << 20;

/// Whether a config file may be believed, held to the trusted keys file's
/// rule: it names the keys that sign desired state, the hypervisor root
/// runs and where root writes, so one that another user owns or may write
/// hands them root. Why not, and how to fix it.
fn trusted(meta: &std::fs::Metadata) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let (owner, mode) = (meta.uid(), meta.mode() & 0o7777);
    if owner != 0 && owner != me {
        return Err(format!(
            "it is owned by uid {owner}, and may only be root's or this agent's user's ({me}), since it decides what root runs and writes; chown {me} FILE"
        ));
    }
    if mode & 0o022 != 0 {
        return Err(format!(
            "it may be written by group or others (mode {mode:04o}), and it decides what root runs and writes; chmod go-w FILE"
        ));
    }
    Ok(())
}

/// The settings a file gives, by key, as text.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct FileSettings {
    pub values: BTreeMap<Key, String>,
}

impl FileSettings {
    /// Reads and checks the file at `path`; the error names the file, what
    /// was wrong and on which line.
    pub fn read(path: &Path) -> Result<FileSettings, ConfigError> {
        use std::io::Read;
        let named = |what: String| err(format!("--config {}: {what}", crate::quote::path(path)));
        let file = std::fs::File::open(path).map_err(|e| named(format!("cannot be read: {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| named(format!("cannot be read: {e}")))?;
        trusted(&meta).map_err(named)?;
        let mut text = String::new();
        file.take(MAX_BYTES)
            .read_to_string(&mut text)
            .map_err(|e| named(format!("cannot be read: {e}")))?;
        FileSettings::parse(&text).map_err(|e| named(e.to_string()))
    }

    pub fn parse(text: &str) -> Result<FileSettings, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(text);
        let values = de::Deserializer::deserialize_map(&mut de, Sections)?;
        de.end()?;
        Ok(FileSettings { values })
    }
}

/// The whole file: sections by name.
struct Sections;

impl<'de> Visitor<'de> for Sections {
    type Value = BTreeMap<Key, String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of sections (")?;
        f.write_str(&section_names())?;
        f.write_str(")")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut values = BTreeMap::new();
        while let Some(name) = map.next_key::<String>()? {
            let Some(section) = Section::ALL.iter().copied().find(|s| s.name() == name) else {
                return Err(de::Error::custom(format!(
                    "unknown section {name:?}; the sections are {}",
                    section_names()
                )));
            };
            map.next_value_seed(Settings {
                section,
                values: &mut values,
            })?;
        }
        Ok(values)
    }
}

fn section_names() -> String {
    let names: Vec<&str> = Section::ALL.iter().map(|s| s.name()).collect();
    names.join(", ")
}

/// One section's object: its settings by flag name.
struct Settings<'v> {
    section: Section,
    values: &'v mut BTreeMap<Key, String>,
}

impl<'de> DeserializeSeed<'de> for Settings<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Settings<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an object of the {:?} section's settings",
            self.section.name()
        )
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let section = self.section;
        while let Some(name) = map.next_key::<String>()? {
            let key = Key::ALL.iter().copied().find(|k| k.setting().flag == name);
            let key = match key {
                Some(k) if k.setting().section == section => k,
                Some(k) => {
                    return Err(de::Error::custom(format!(
                        "{name:?} belongs in section {:?}, not {:?}",
                        k.setting().section.name(),
                        section.name()
                    )));
                }
                None => {
                    let known: Vec<&str> = Key::ALL
                        .iter()
                        .map(|k| k.setting())
                        .filter(|s| s.section == section)
                        .map(|s| s.flag)
                        .collect();
                    return Err(de::Error::custom(format!(
                        "unknown setting {name:?} in section {:?}; its settings are {}",
                        section.name(),
                        known.join(", ")
                    )));
                }
            };
            let text = map.next_value::<Value>()?.0;
            if self.values.insert(key, text).is_some() {
                return Err(de::Error::custom(format!(
                    "{name:?} is given twice in section {:?}",
                    section.name()
                )));
            }
        }
        Ok(())
    }
}

/// A setting's value as the text its flag would take.
struct Value(String);

impl<'de> de::Deserialize<'de> for Value {
    fn deserialize<D: de::Deserializer<'de>>(de: D) -> Result<Value, D::Error> {
        de.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a number, a boolean or an array of strings")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value(v.to_owned()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value(v.to_string()))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value(v.to_string()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Err(E::custom(format!(
            "{v} is not a whole number; no setting takes a fraction"
        )))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value(if v { "yes" } else { "no" }.to_owned()))
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<String>()? {
            if item.contains(',') {
                return Err(de::Error::custom(format!(
                    "{item:?} has a comma; give each item as its own string"
                )));
            }
            items.push(item);
        }
        Ok(Value(items.join(",")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_read_by_section_as_their_flags_text() {
        let file = FileSettings::parse(
            r#"{
                "reconcile": { "tick": "2s", "max-create-attempts": 5 },
                "network": { "guest-deny": ["10.0.0.0/8", "192.168.0.0/16"] },
                "source": { "token-in-clear": true }
            }"#,
        )
        .expect("valid");

        assert_eq!(file.values[&Key::Tick], "2s");
        assert_eq!(file.values[&Key::MaxCreateAttempts], "5");
        assert_eq!(file.values[&Key::GuestDeny], "10.0.0.0/8,192.168.0.0/16");
        assert_eq!(file.values[&Key::TokenInClear], "yes");
    }

    #[test]
    fn an_unknown_setting_is_refused_with_its_line() {
        let e = FileSettings::parse(
            "{\n  \"hypervisor\": {\n    \"kernal\": \"/boot/vmlinux\"\n  }\n}",
        )
        .expect_err("typo")
        .to_string();

        assert!(e.contains("unknown setting \"kernal\""), "{e}");
        assert!(e.contains("kernel"), "the known names are listed: {e}");
        assert!(e.contains("line 3"), "{e}");
    }

    #[test]
    fn an_unknown_section_is_refused_with_its_line() {
        let e = FileSettings::parse("{\n\n \"hypervisors\": {}\n}")
            .expect_err("typo")
            .to_string();

        assert!(e.contains("unknown section \"hypervisors\""), "{e}");
        assert!(e.contains("line 3"), "{e}");
    }

    #[test]
    fn a_setting_in_the_wrong_section_names_its_own() {
        let e = FileSettings::parse(r#"{"images": {"tick": "1s"}}"#)
            .expect_err("misplaced")
            .to_string();

        assert!(
            e.contains("\"tick\" belongs in section \"reconcile\""),
            "{e}"
        );
    }

    #[test]
    fn a_setting_given_twice_is_refused() {
        let e = FileSettings::parse(r#"{"reconcile": {"tick": "1s", "tick": "2s"}}"#)
            .expect_err("twice")
            .to_string();

        assert!(e.contains("given twice"), "{e}");
    }

    #[test]
    fn a_null_value_is_refused() {
        let e = FileSettings::parse(r#"{"reconcile": {"tick": null}}"#)
            .expect_err("null")
            .to_string();

        assert!(e.contains("line 1"), "{e}");
    }
}
