//! The engine test harness: a state dir, a store, the fakes and an engine
//! over them, with helpers to run ticks and read rows.

#![allow(dead_code)] // each test file uses its own subset

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use eitri_agent::deadline::Deadline;
use eitri_agent::model::{Report, Snapshot, VmStatus};
use eitri_agent::reconcile::{Engine, EngineConfig};
use eitri_agent::state::{Record, Store};
use eitri_agent::testkit::{Fakes, id};

/// How long a test waits for the engine to go idle before failing. A bound
/// to fail on, not a measurement: passes against fakes take microseconds.
pub const SETTLE: Duration = Duration::from_secs(10);

pub const VANISH_GRACE: Duration = Duration::from_secs(120);
pub const TOMBSTONE_GRACE: Duration = Duration::from_secs(60);
pub const CREATE_REARM: Duration = Duration::from_secs(3600);

pub fn config() -> EngineConfig {
    EngineConfig {
        agent_version: "1.0.0".into(),
        vm_timeout: Some(Duration::from_secs(30)),
        tombstone_grace: TOMBSTONE_GRACE,
        vanish_grace: VANISH_GRACE,
        max_create_attempts: 3,
        create_rearm: CREATE_REARM,
        max_concurrent_creates: 4,
        caps: Default::default(),
        worker_stack_bytes: 256 * 1024,
    }
}

pub struct Harness {
    pub dir: tempfile::TempDir,
    pub store: Arc<Store>,
    pub fakes: Arc<Fakes>,
    pub engine: Engine,
    pub config: EngineConfig,
}

impl Harness {
    pub fn new() -> Harness {
        Harness::with_config(config())
    }

    pub fn with_config(config: EngineConfig) -> Harness {
        Harness::open(tempfile::tempdir().expect("tempdir"), Fakes::new(), config)
    }

    /// Over a backend with no capability but its lifecycle (see
    /// [`Fakes::lack_capabilities`]).
    pub fn bare() -> Harness {
        let fakes = Fakes::new();
        fakes.lack_capabilities();
        Harness::open(tempfile::tempdir().expect("tempdir"), fakes, config())
    }

    fn open(dir: tempfile::TempDir, fakes: Arc<Fakes>, config: EngineConfig) -> Harness {
        let store = Arc::new(Store::open(dir.path()).expect("store"));
        let engine = Engine::new(Arc::clone(&store), fakes.seams(), config.clone());
        Harness {
            dir,
            store,
            fakes,
            engine,
            config,
        }
    }

    /// A new agent process over the same state dir and the same host (the
    /// fakes keep their running VMs, as real hypervisors outlive the agent).
    pub fn restart(self) -> Harness {
        let Harness {
            dir,
            store,
            fakes,
            engine,
            config,
        } = self;
        drop(engine);
        drop(store);
        Harness::open(dir, fakes, config)
    }

    /// As [`Harness::restart`], the new agent's backend [`Harness::bare`].
    pub fn restart_bare(self) -> Harness {
        let Harness {
            dir,
            store,
            fakes,
            engine,
            config,
        } = self;
        drop(engine);
        drop(store);
        fakes.lack_capabilities();
        Harness::open(dir, fakes, config)
    }

    /// One tick: step, then wait until every pass it started has ended.
    /// Returns the step's own report (made before those passes ran).
    pub fn tick(&self, snap: &Snapshot) -> Report {
        let report = self.engine.step(snap);
        self.idle();
        report
    }

    pub fn idle(&self) {
        assert!(
            self.engine.wait_idle(Deadline::after(SETTLE)),
            "engine did not go idle"
        );
    }

    /// The VM's last published row.
    pub fn row(&self, vm: &str) -> VmStatus {
        self.try_row(vm)
            .unwrap_or_else(|| panic!("no row for {vm}: {:?}", self.engine.published()))
    }

    pub fn try_row(&self, vm: &str) -> Option<VmStatus> {
        self.engine
            .published()
            .vms
            .into_iter()
            .find(|r| r.vm_id == vm)
            .map(std::sync::Arc::unwrap_or_clone)
    }

    pub fn record(&self, vm: &str) -> Record {
        let rec = self.store.get(&id(vm)).expect("readable").expect("present");
        (*rec).clone()
    }

    pub fn has_record(&self, vm: &str) -> bool {
        self.store.get(&id(vm)).expect("readable").is_some()
    }

    /// Ticks until `done` holds for the VM's row, at most 100 ticks.
    pub fn tick_until(
        &self,
        snap: &Snapshot,
        vm: &str,
        done: impl Fn(&VmStatus) -> bool,
    ) -> VmStatus {
        for _ in 0..100 {
            self.tick(snap);
            if let Some(row) = self.try_row(vm)
                && done(&row)
            {
                return row;
            }
        }
        panic!("{vm} never reached the state: {:?}", self.try_row(vm));
    }

    /// Makes saving `vm`'s record fail: its directory becomes a file, so the
    /// store cannot write into it (root ignores permission bits, so a mode
    /// change would not do).
    pub fn break_record_dir(&self, vm: &str) {
        let dir = self.store.layout().vm_dir(&id(vm));
        std::fs::remove_dir_all(&dir).expect("remove vm dir");
        std::fs::write(&dir, b"not a directory").expect("file in its place");
    }
}

/// Every file under `root` with its length, modification time and content,
/// to show a step wrote nothing.
pub fn tree_fingerprint(root: &Path) -> Vec<(String, u64, std::time::SystemTime, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir") {
            let entry = entry.expect("entry");
            let meta = entry.metadata().expect("metadata");
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                let content = if meta.len() < 1 << 20 {
                    std::fs::read(entry.path()).unwrap_or_default()
                } else {
                    Vec::new()
                };
                out.push((
                    entry.path().display().to_string(),
                    meta.len(),
                    meta.modified().expect("mtime"),
                    content,
                ));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Threads of this process (nextest runs each test in its own process).
pub fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").expect("tasks").count()
}
