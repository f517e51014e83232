//! Data-parallel ranks in the pipelines: which device and which teacher server a rank takes,
//! and work done by one rank per machine at a time (hub downloads into a machine's cache).

use burn::tensor::Device;
use kd_dist::World;

use crate::error::{PipelineError, Result};

/// The device this rank runs on, from the devices `flag` names (`--draft_gpus 4,5,6,7`,
/// `device_mapping`), and a warning when devices go unused:
/// - one device: every rank takes it (`cpu`, or ranks sharing one GPU);
/// - one rank per device on this machine: rank `local_rank` takes device `local_rank`;
/// - a process alone with several devices: the first one, and a warning that says how to use
///   them all (`mpirun -np N`);
/// - otherwise (more ranks on this machine than devices, or fewer): an error.
pub fn rank_device(
    flag: &str,
    devices: &[Device],
    world: &World,
) -> Result<(Device, Option<String>)> {
    let Some(first) = devices.first() else {
        return Err(PipelineError::Config(format!("{flag} names no device")));
    };
    if devices.len() == 1 {
        return Ok((first.clone(), None));
    }
    if !world.is_distributed() {
        return Ok((
            first.clone(),
            Some(format!(
                "{flag} names {n} devices; this process runs on the first one. Launch one \
                 data-parallel rank per device to use them all: `mpirun -np {n} …` (or \
                 `srun --mpi=pmix -n {n} …`)",
                n = devices.len()
            )),
        ));
    }
    if devices.len() == world.local_size() {
        return Ok((devices[world.local_rank()].clone(), None));
    }
    Err(PipelineError::Config(format!(
        "{flag} names {} devices but {} ranks run on this machine: name one device per rank \
         on each machine (rank k on a machine takes device k), or one device for all of them",
        devices.len(),
        world.local_size()
    )))
}

/// Runs `work` on one rank of each machine at a time — the ranks with local rank 0 first, then
/// those with local rank 1, … — for work that fills a machine-local cache (a hub download into
/// the Hugging Face cache): the first rank on each machine does it, the others find it done.
/// Alone: just `work`. Every rank takes part in every turn, so an error on one waits for the
/// turns to end and is then returned.
pub fn local_turns<T>(world: &World, work: impl FnOnce() -> Result<T>) -> Result<T> {
    if !world.is_distributed() {
        return work();
    }
    let sizes = world.all_gather_bytes(&(world.local_size() as u64).to_le_bytes())?;
    let turns = sizes
        .iter()
        .filter_map(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
        .map(u64::from_le_bytes)
        .max()
        .unwrap_or(1);
    let mut work = Some(work);
    let mut out = None;
    for turn in 0..turns {
        if turn == world.local_rank() as u64
            && let Some(w) = work.take()
        {
            out = Some(w());
        }
        world.barrier()?;
    }
    match (out, work) {
        (Some(out), _) => out,
        // A local rank past every machine's count cannot be; do the work rather than fail.
        (None, Some(w)) => w(),
        (None, None) => Err(PipelineError::Config(
            "a rank neither did its turn's work nor kept it".into(),
        )),
    }
}

/// The teacher server this rank talks to, from `urls`: one URL, or a comma-separated list of
/// which rank r takes entry r mod n (one server per node, say). With a list, the second value
/// is the teachers' fingerprint for the caches: the whole list, so that every rank opens the
/// same cache (the servers must serve the same model).
pub fn rank_url(urls: &str, world: &World) -> Result<(String, Option<String>)> {
    let list: Vec<&str> = urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    match list.as_slice() {
        [] => Err(PipelineError::Config(format!(
            "the teacher URL {urls:?} names no server"
        ))),
        [one] => Ok((one.to_string(), None)),
        many => Ok((
            many[world.rank() % many.len()].to_string(),
            Some(format!("remote servers {}", many.join(","))),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alone_takes_the_first_device_and_says_how_to_use_the_rest() {
        let world = World::alone();
        let one = [Device::flex()];
        let (d, w) = rank_device("--draft_gpus", &one, &world).unwrap();
        assert!(d == Device::flex());
        assert!(w.is_none());
        let two = [Device::flex(), Device::flex()];
        let (_, w) = rank_device("--draft_gpus", &two, &world).unwrap();
        let w = w.unwrap();
        assert!(w.contains("2 devices") && w.contains("mpirun -np 2"), "{w}");
        assert!(rank_device("--draft_gpus", &[], &world).is_err());
    }

    #[test]
    fn a_list_of_teacher_urls_gives_each_rank_one() {
        let world = World::alone();
        assert_eq!(
            rank_url("http://a:30000", &world).unwrap(),
            ("http://a:30000".to_string(), None)
        );
        let (url, fingerprint) = rank_url("http://a:1, http://b:1", &world).unwrap();
        assert_eq!(url, "http://a:1");
        assert_eq!(
            fingerprint.as_deref(),
            Some("remote servers http://a:1,http://b:1")
        );
        assert!(rank_url(" , ", &world).is_err());
    }
}
