//! Managed by `cargo hakari`: every workspace crate depends on this one, which asks for the
//! union of the features the whole workspace (tests and dev-dependencies included) enables
//! on shared dependencies. So `cargo run -p speculator` after `cargo test --workspace`
//! compiles only the workspace's own crates instead of a second build of Burn.
//! After changing dependencies: `cargo hakari generate && cargo hakari manage-deps`.
