//! Standalone mode: desired state from a JSON file with the proto's field
//! names.
//!
//! Reading, in order:
//! 1. stat the file; unchanged since the last read means nothing new, but a
//!    file that was bad is reported bad again: its error stands, in the log
//!    once and in every contact, until the file is fixed.
//! 2. Read at most the byte limit.
//! 3. The top level: an object of `epoch`, `min_agent_version`, `vms` and
//!    `volumes`. A syntax error, an unknown key or a wrong type there makes
//!    the whole file bad, and the previous desired state stands. Entries are
//!    counted against the limits as they are read, and kept as raw text.
//! 4. Each entry on its own, key by key: a misspelt key (`"vcpu"`) or a
//!    wrong type (`"vcpus": "2"`, `1.5`, `2^70`) refuses that entry alone,
//!    naming the key and its line, while the rest of the file is acted on,
//!    as a bad entry from a control plane is. A refused entry with a valid
//!    id still claims it: the VM is left alone, never reaped.

use std::collections::HashSet;
use std::fmt;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{Desired, SnapshotLimits, Source, SourceError};
use crate::model::{Id, Rejected, SpecError};
use crate::pb;
use crate::trust::{self, Refusal, TrustedKeys, Verified};

pub struct FileSource {
    path: PathBuf,
    limits: SnapshotLimits,
    /// `--trusted-keys`: with them, the file is taken only signed by a
    /// pinned key over its exact bytes: by a detached signature
    /// (`FILE.sig`), or by its own first line (`sign --embed`), which one
    /// rename replaces with the bytes it signs.
    trust: Option<TrustedKeys>,
    /// The file's stamp and its signature's when last read.
    seen: Option<(Stamp, Option<Stamp>)>,
    /// Why the file as it stands cannot be read, repeated at every contact.
    broken: Option<Broken>,
    /// Why the file as it stands is not trusted, likewise.
    refused: Option<Refusal>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    inode: u64,
}

impl Stamp {
    fn of(path: &Path) -> std::io::Result<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let meta = fs::metadata(path)?;
        Ok(Stamp {
            len: meta.len(),
            modified: meta.modified().ok(),
            inode: meta.ino(),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Broken {
    line: usize,
    column: usize,
    problem: String,
}

impl FileSource {
    pub fn new(path: PathBuf, limits: SnapshotLimits, trust: Option<TrustedKeys>) -> FileSource {
        FileSource {
            path,
            limits,
            trust,
            seen: None,
            broken: None,
            refused: None,
        }
    }

    /// Where the detached signature of `path` lives: beside it, `.sig`
    /// appended.
    pub fn signature_path(path: &Path) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(".sig");
        PathBuf::from(name)
    }

    fn refusal(&self, why: Refusal) -> SourceError {
        SourceError::Refused {
            from: format!("{}", self.path.display()),
            why,
        }
    }

    /// The verified signer of `bytes`: by `embedded`, the file's own
    /// signature line, or else by the signature beside the file.
    fn verify(
        &self,
        keys: &TrustedKeys,
        embedded: Option<&str>,
        bytes: &[u8],
    ) -> Result<Verified, Refusal> {
        if let Some(line) = embedded {
            let (key_id, signature) =
                trust::parse_signature_line(line).map_err(|e| Refusal::Unsigned {
                    why: format!(
                        "the first line of {} is not a signature: {e}",
                        self.path.display()
                    ),
                })?;
            return keys.verify(&key_id, &signature, bytes);
        }
        let sig_path = FileSource::signature_path(&self.path);
        let mut line = String::new();
        let read =
            fs::File::open(&sig_path).and_then(|f| f.take(4 << 10).read_to_string(&mut line));
        if let Err(e) = read {
            return Err(Refusal::Unsigned {
                why: format!(
                    "no signature {}: {e}; sign the file with `eitri-agent sign --key KEY {}`",
                    sig_path.display(),
                    self.path.display()
                ),
            });
        }
        let (key_id, signature) =
            trust::parse_signature_line(&line).map_err(|e| Refusal::Unsigned {
                why: format!("{} is not a signature: {e}", sig_path.display()),
            })?;
        keys.verify(&key_id, &signature, bytes)
    }

    fn malformed(&self, broken: &Broken) -> SourceError {
        SourceError::Malformed {
            path: self.path.clone(),
            line: broken.line,
            column: broken.column,
            problem: broken.problem.clone(),
        }
    }
}

impl Source for FileSource {
    fn fetch(&mut self, host: &pb::HostInfo) -> Result<Option<Desired>, SourceError> {
        let read_err = |source| SourceError::ReadFile {
            path: self.path.clone(),
            source,
        };
        let stamp = Stamp::of(&self.path).map_err(read_err)?;
        let sig_stamp = match &self.trust {
            Some(_) => Stamp::of(&FileSource::signature_path(&self.path)).ok(),
            None => None,
        };
        if self.seen == Some((stamp, sig_stamp)) {
            return match (&self.broken, &self.refused) {
                (Some(broken), _) => Err(self.malformed(broken)),
                (None, Some(why)) => Err(self.refusal(why.clone())),
                (None, None) => Ok(None),
            };
        }
        let mut text = String::new();
        fs::File::open(&self.path)
            .and_then(|f| {
                f.take(self.limits.max_bytes.saturating_add(1))
                    .read_to_string(&mut text)
            })
            .map_err(read_err)?;
        self.seen = Some((stamp, sig_stamp));
        self.broken = None;
        self.refused = None;
        // A host without keys takes the bytes an embedded line signs as it
        // takes any unsigned file.
        let (embedded, body) = trust::split_embedded(&text);
        // The signature first: nothing of an untrusted file is parsed.
        let signed_by = match &self.trust {
            None => None,
            Some(keys) => match self.verify(keys, embedded, body.as_bytes()) {
                Ok(verified) => Some(verified.key_id),
                Err(why) => {
                    self.refused = Some(why.clone());
                    return Err(self.refusal(why));
                }
            },
        };
        let parsed = if text.len() as u64 > self.limits.max_bytes {
            Err(Broken {
                line: 1,
                column: 1,
                problem: format!(
                    "the file is larger than {} bytes; raise --max-response-bytes if that is expected",
                    self.limits.max_bytes
                ),
            })
        } else {
            match embedded {
                // Its signature line blanked, not cut: every line and column
                // an error names is the file's own.
                Some(line) => parse(&format!("{}\n{body}", " ".repeat(line.len())), self.limits),
                None => parse(&text, self.limits),
            }
        };
        match parsed {
            Ok(mut desired) => {
                let checked = super::admissible(signed_by.as_deref(), &desired.wire, &host.host_id);
                if let Err(why) = checked {
                    self.refused = Some(why.clone());
                    return Err(self.refusal(why));
                }
                desired.signed_by = signed_by;
                desired.digest = Some(super::digest_of(body.as_bytes()));
                Ok(Some(desired))
            }
            Err(broken) => {
                let err = self.malformed(&broken);
                self.broken = Some(broken);
                Err(err)
            }
        }
    }

    fn send_report(
        &mut self,
        _host: &pb::HostInfo,
        _report: &pb::Report,
    ) -> Result<(), SourceError> {
        Ok(())
    }

    fn is_remote(&self) -> bool {
        false
    }

    fn reload(&mut self) {
        if let Some(keys) = &mut self.trust {
            keys.reload();
        }
        self.seen = None;
    }

    fn describe(&self) -> String {
        format!("desired file {}", self.path.display())
    }

    #[cfg(target_os = "linux")]
    fn watch(
        &mut self,
        changed: crossbeam_channel::Sender<()>,
    ) -> std::io::Result<Option<super::Watcher>> {
        super::Watcher::start(&self.path, changed).map(Some)
    }
}

/// Reads a desired file's text (steps 3 and 4 of the module).
fn parse(text: &str, limits: SnapshotLimits) -> Result<Desired, Broken> {
    let mut de = serde_json::Deserializer::from_str(text);
    let top = TopLevel { limits }
        .deserialize(&mut de)
        .and_then(|top| de.end().map(|()| top))
        .map_err(|e| Broken {
            line: e.line(),
            column: e.column(),
            problem: e.to_string(),
        })?;
    let mut desired = Desired {
        wire: pb::Snapshot {
            epoch: top.epoch,
            min_agent_version: top.min_agent_version,
            host_id: top.host_id,
            epoch_reset: top.epoch_reset,
            epoch_reset_from: top.epoch_reset_from,
            not_after_unix_ms: top.not_after_unix_ms,
            ..pb::Snapshot::default()
        },
        ..Desired::default()
    };
    let lines = Lines::of(text);
    for raw in top.vms {
        match entry(&lines, raw, "vm_id") {
            Ok(vm) => desired.wire.vms.push(vm),
            Err(rejected) => desired.refused_vms.push(rejected),
        }
    }
    for raw in top.volumes {
        match entry(&lines, raw, "volume_id") {
            Ok(volume) => desired.wire.volumes.push(volume),
            Err(rejected) => desired.refused_volumes.push(rejected),
        }
    }
    Ok(desired)
}

/// One entry, checked key by key so the error names the key and its line.
fn entry<T: DeserializeOwned>(
    lines: &Lines<'_>,
    raw: &RawValue,
    id_key: &str,
) -> Result<T, Rejected> {
    let body = raw.get();
    let line = lines.line_of(body);
    let refuse = |id: Option<Id>, raw_id: String, problem: String| Rejected {
        id,
        raw_id,
        error: SpecError::new("entry", problem),
    };
    let Ok(map) = serde_json::from_str::<Map<String, Value>>(body) else {
        return Err(refuse(
            None,
            String::new(),
            format!("the entry at line {line} is not an object"),
        ));
    };
    let raw_id = map
        .get(id_key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let id = Id::parse(&raw_id).ok();
    // Read from the entry's text with its keys made unique (the last of
    // a repeated key counts, as in the object above): one deserializer
    // for every entry type, the one the rest of the file uses, where
    // reading from a `Value` took one more of its own.
    let whole = |map: &Map<String, Value>| {
        serde_json::to_string(map)
            .map_err(|e| e.to_string())
            .and_then(|text| serde_json::from_str::<T>(&text).map_err(|e| e.to_string()))
    };
    whole(&map).map_err(|e| {
        // Which key is wrong: the first that cannot be read alone.
        for (key, value) in &map {
            let alone = Map::from_iter([(key.clone(), value.clone())]);
            if let Err(e) = whole(&alone) {
                let key_line =
                    line + line_at(body, body.find(&format!("\"{key}\"")).unwrap_or(0)) - 1;
                return refuse(
                    id.clone(),
                    raw_id.clone(),
                    format!("{key:?} at line {key_line}: {e}"),
                );
            }
        }
        refuse(
            id.clone(),
            raw_id.clone(),
            format!("the entry at line {line}: {e}"),
        )
    })
}

/// Where `part` (a slice of `text`) starts in it.
fn offset_in(text: &str, part: &str) -> usize {
    (part.as_ptr() as usize)
        .checked_sub(text.as_ptr() as usize)
        .filter(|o| *o <= text.len())
        .unwrap_or(0)
}

/// A text's newlines, found once, so each entry's line is a search and
/// not a count from the start (which, for ten thousand entries in a 16 MiB
/// file, read the file ten thousand times).
struct Lines<'a> {
    text: &'a str,
    newlines: Vec<usize>,
}

impl<'a> Lines<'a> {
    fn of(text: &'a str) -> Lines<'a> {
        Lines {
            text,
            newlines: text
                .bytes()
                .enumerate()
                .filter(|(_, b)| *b == b'\n')
                .map(|(i, _)| i)
                .collect(),
        }
    }

    /// The 1-based line where `part` (a slice of the text) starts.
    fn line_of(&self, part: &str) -> usize {
        let offset = offset_in(self.text, part);
        self.newlines.partition_point(|n| *n < offset) + 1
    }
}

/// The 1-based line of byte `offset` in `text`.
fn line_at(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// The top level of a desired file, its entries left as raw text.
#[derive(Default)]
struct TopLevelValue<'a> {
    epoch: u64,
    host_id: String,
    epoch_reset: bool,
    epoch_reset_from: u64,
    not_after_unix_ms: u64,
    min_agent_version: String,
    vms: Vec<&'a RawValue>,
    volumes: Vec<&'a RawValue>,
}

struct TopLevel {
    limits: SnapshotLimits,
}

impl<'de> DeserializeSeed<'de> for TopLevel {
    type Value = TopLevelValue<'de>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TopLevel {
    type Value = TopLevelValue<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object with epoch, min_agent_version, vms and volumes")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = TopLevelValue::default();
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(format!("the key {key:?} is given twice")));
            }
            match key.as_str() {
                "epoch" => out.epoch = map.next_value()?,
                "host_id" => out.host_id = map.next_value()?,
                "epoch_reset" => out.epoch_reset = map.next_value()?,
                "epoch_reset_from" => out.epoch_reset_from = map.next_value()?,
                "not_after_unix_ms" => out.not_after_unix_ms = map.next_value()?,
                "min_agent_version" => out.min_agent_version = map.next_value()?,
                "vms" => {
                    out.vms = map.next_value_seed(Entries {
                        max: self.limits.max_vms,
                        what: "VM",
                        flag: "--max-vms",
                    })?;
                }
                "volumes" => {
                    out.volumes = map.next_value_seed(Entries {
                        max: self.limits.max_volumes,
                        what: "volume",
                        flag: "--max-volumes",
                    })?;
                }
                other => {
                    return Err(de::Error::custom(format!(
                        "unknown key {other:?}; a desired file's keys are epoch, min_agent_version, vms, volumes, host_id, epoch_reset, epoch_reset_from and not_after_unix_ms"
                    )));
                }
            }
        }
        Ok(out)
    }
}

/// A list of entries kept as raw text, refused past `max` while it is
/// read, before a larger list costs memory.
struct Entries {
    max: usize,
    what: &'static str,
    flag: &'static str,
}

impl<'de> DeserializeSeed<'de> for Entries {
    type Value = Vec<&'de RawValue>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Entries {
    type Value = Vec<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a list of {} entries", self.what)
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
        let mut out = Vec::new();
        while let Some(entry) = seq.next_element::<&'de RawValue>()? {
            if out.len() == self.max {
                return Err(de::Error::custom(format!(
                    "more than {} {} entries; raise {} if this host really takes that many",
                    self.max, self.what, self.flag
                )));
            }
            out.push(entry);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Desired, Broken> {
        parse(text, SnapshotLimits::default())
    }

    #[test]
    fn a_misspelt_key_below_a_signature_line_is_named_at_the_files_own_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("desired.json");
        let body = "{\"vms\": [\n  {\"vm_id\": \"b\",\n   \"vcpu\": 2}\n]}";
        std::fs::write(&path, format!("ed25519 k c2ln\n{body}")).expect("file");
        let mut source = FileSource::new(path, SnapshotLimits::default(), None);

        let desired = source
            .fetch(&pb::HostInfo::default())
            .expect("read")
            .expect("new");

        let why = desired.refused_vms[0].error.to_string();
        assert!(why.contains("\"vcpu\" at line 4"), "{why}");
    }

    #[test]
    fn a_misspelt_key_refuses_that_entry_only_naming_key_and_line() {
        let text = "{\"vms\": [\n  {\"vm_id\": \"a\", \"vcpus\": 1},\n  {\"vm_id\": \"b\",\n   \"vcpu\": 2}\n]}";

        let desired = read(text).expect("the file as a whole is fine");

        assert_eq!(desired.wire.vms.len(), 1);
        assert_eq!(desired.refused_vms.len(), 1);
        let refused = &desired.refused_vms[0];
        assert_eq!(refused.raw_id, "b");
        assert_eq!(refused.id, Some(Id::parse("b").expect("id")));
        let why = refused.error.to_string();
        assert!(
            why.contains("\"vcpu\" at line 4") && why.contains("unknown field"),
            "{why}"
        );
    }

    #[test]
    fn wrong_types_refuse_the_entry_naming_the_key() {
        for value in ["\"2\"", "1.5", "1180591620717411303424"] {
            let text = format!("{{\"vms\": [{{\"vm_id\": \"a\", \"vcpus\": {value}}}]}}");

            let desired = read(&text).expect("the file as a whole is fine");

            assert!(desired.wire.vms.is_empty(), "{value}");
            let why = desired.refused_vms[0].error.to_string();
            assert!(why.contains("\"vcpus\" at line 1"), "{value}: {why}");
        }
    }

    #[test]
    fn an_unknown_top_level_key_makes_the_file_bad() {
        let broken = read("{\n\"vm\": []\n}").expect_err("bad file");

        assert_eq!(broken.line, 2);
        assert!(
            broken.problem.contains("unknown key \"vm\""),
            "{}",
            broken.problem
        );
    }

    #[test]
    fn more_entries_than_the_limit_are_refused_while_reading() {
        let limits = SnapshotLimits {
            max_vms: 2,
            ..SnapshotLimits::default()
        };

        let broken = parse("{\"vms\": [{}, {}, {}]}", limits).expect_err("too many");

        assert!(
            broken.problem.contains("more than 2 VM entries"),
            "{}",
            broken.problem
        );
    }

    #[test]
    fn a_bad_file_is_reported_at_every_contact_until_it_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("desired.json");
        std::fs::write(&path, "{not json").expect("write");
        let mut source = FileSource::new(path.clone(), SnapshotLimits::default(), None);
        let host = pb::HostInfo::default();

        let first = source.fetch(&host);
        let second = source.fetch(&host);
        std::fs::write(&path, "{}").expect("fix");
        let fixed = source.fetch(&host);

        assert!(matches!(first, Err(SourceError::Malformed { .. })));
        assert!(matches!(second, Err(SourceError::Malformed { .. })));
        assert!(matches!(fixed, Ok(Some(_))));
    }
}
