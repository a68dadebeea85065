//! idemgate placeholder
