//! Shared helpers live in mnemo-testkit; this crate only holds the test files.
