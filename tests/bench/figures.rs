//! What the benchmarks share: the engine's seams over a real backend,
//! milliseconds, percentiles, and a pass's stages as medians.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use eitri_agent::hostkey::LocalHostKeys;
use eitri_agent::image::{ImageCache, ImageOptions};
use eitri_agent::provision::Provisioner;
use eitri_agent::provision::cloudhv::{CloudHvConfig, CloudHypervisor};
use eitri_agent::reconcile::Seams;
use eitri_agent::seed::NoCloudSeed;
use eitri_agent::stages::Stages;
use eitri_agent::state::Store;

/// The seams of an engine over the cloud-hypervisor backend `cfg` drives,
/// base images served from under `images` (`file://`).
pub fn seams(store: &Arc<Store>, cfg: CloudHvConfig, images: &Path) -> Seams {
    let backend = Arc::new(CloudHypervisor::new(Arc::clone(store), cfg));
    Seams {
        provisioner: backend as Arc<dyn Provisioner>,
        images: Arc::new(ImageCache::with(
            store.layout().images(),
            &ImageOptions {
                file_root: Some(images.to_path_buf()),
                ..ImageOptions::default()
            },
        )),
        seed: Arc::new(NoCloudSeed),
        host_keys: Arc::new(LocalHostKeys),
        host: eitri_agent::testkit::Fakes::new().seams().host,
    }
}

/// The median of every stage the passes of `traces` went through, in the
/// order of the first, and of their totals; `what` names the passes.
pub fn print_stages(what: &str, traces: &[Stages]) {
    let mut order: Vec<&'static str> = Vec::new();
    for trace in traces {
        for mark in &trace.marks {
            if !order.contains(&mark.stage) {
                order.push(mark.stage);
            }
        }
    }
    println!(
        "stage medians over {} {what} (ms; nested stages are inside their parents):",
        traces.len()
    );
    for stage in order {
        let values: Vec<f64> = traces.iter().map(|t| ms(t.of(stage))).collect();
        let count = traces
            .first()
            .map_or(0, |t| t.marks.iter().filter(|m| m.stage == stage).count());
        println!("  {stage:<16} {:>8.3}  (×{count})", percentile(values, 0.5));
    }
    println!(
        "  {:<16} {:>8.3}",
        "total",
        percentile(traces.iter().map(|t| ms(t.total)).collect(), 0.5)
    );
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn percentile(mut values: Vec<f64>, p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values
        .get(((values.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}
