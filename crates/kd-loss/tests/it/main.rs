//! kd-loss against PyTorch (fixtures/make_loss_golden.py) and mathematical properties.

mod util;

mod eagle3;
mod golden;
mod levels;
mod linear;
mod properties;
