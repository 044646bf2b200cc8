module github.com/idemkit/idem/storetest

go 1.25.0

require (
	github.com/anishathalye/porcupine v1.3.1
	github.com/idemkit/idem v0.0.0-00010101000000-000000000000
)

replace github.com/idemkit/idem => ..
