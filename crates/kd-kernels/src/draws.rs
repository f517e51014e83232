//! Initial weights drawn from a seed of their own.

use burn::tensor::{DType, Device, Distribution, Tensor, TensorData};
use burn_rand::SeedableRng;
use burn_rand::rngs::StdRng;

/// A generator of initial weights: the values that Burn's CPU backend gives
/// `Tensor::random` after `device.seed(seed)`, in the same order, but from a generator this
/// value owns.
///
/// The backend's own generator is one for the whole process, shared by every thread: two
/// runs side by side in one process (tests, a service training several drafts) interleave
/// their draws from it, and which run gets which values depends on timing. Here each run
/// draws from its own, so the same seed gives the same weights whatever else the process
/// does. On the CPU backend they are the values the shared generator gave a run alone (the
/// same `StdRng`, seeded the same way, drawn through the same `TensorData::random`); on
/// other devices the values are drawn here and copied there.
pub struct SeededDraws(StdRng);

impl SeededDraws {
    /// A generator seeded with `seed` (as `device.seed(seed)` seeds the CPU backend's).
    pub fn new(seed: u64) -> Self {
        Self(StdRng::seed_from_u64(seed))
    }

    /// The next f32 tensor of `shape` drawn from `distribution`, on `device`.
    pub fn tensor<const D: usize>(
        &mut self,
        shape: [usize; D],
        distribution: Distribution,
        device: &Device,
    ) -> Tensor<D> {
        let data = TensorData::random::<f32, _, _>(shape, distribution, &mut self.0);
        Tensor::from_data(data, (device, DType::F32))
    }
}

impl std::fmt::Debug for SeededDraws {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SeededDraws")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(t: Tensor<2>) -> Vec<u32> {
        t.into_data()
            .try_to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    }

    const SHAPES: [[usize; 2]; 3] = [[7, 5], [3, 11], [16, 4]];

    /// The distribution of draw `i`: normal, then uniform, then normal again.
    fn distribution(i: usize) -> Distribution {
        if i == 1 {
            Distribution::Uniform(-0.3, 0.3)
        } else {
            Distribution::Normal(0.0, 0.02)
        }
    }

    fn draws(seed: u64, device: &Device) -> Vec<Vec<u32>> {
        let mut rng = SeededDraws::new(seed);
        SHAPES
            .iter()
            .enumerate()
            .map(|(i, &s)| bits(rng.tensor(s, distribution(i), device)))
            .collect()
    }

    /// The values are those the CPU backend's generator gives after `device.seed(seed)`
    /// (the only test in this binary that draws from it), and the same on every thread while
    /// other threads reseed and draw from the backend's generator.
    #[test]
    fn the_backends_values_from_a_generator_of_its_own() {
        let device = Device::flex();
        device.seed(42);
        let shared: Vec<Vec<u32>> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                bits(Tensor::<2>::random(
                    s,
                    distribution(i),
                    (&device, DType::F32),
                ))
            })
            .collect();
        assert_eq!(draws(42, &device), shared);
        assert_ne!(draws(43, &device), shared);

        let runs: Vec<Vec<Vec<Vec<u32>>>> = crate::testing::beside_other_draws(|| {
            std::thread::scope(|scope| {
                let runs: Vec<_> = (0..2)
                    .map(|_| {
                        scope.spawn(|| (0..50).map(|_| draws(42, &device)).collect::<Vec<_>>())
                    })
                    .collect();
                runs.into_iter()
                    .map(|r| r.join().expect("a drawing thread panicked"))
                    .collect()
            })
        });
        for d in runs.into_iter().flatten() {
            assert_eq!(d, shared);
        }
    }
}
