"""Programs written only against Stalwart's public API (`import stalwart`), shipped as
`stalwart_examples` so `stalwart demo` can launch them from an installed package."""
