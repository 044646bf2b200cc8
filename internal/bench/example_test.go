package bench_test

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/idem/internal/bench"
)

// A short run on memstore only: every cell reports its consistency check.
func ExampleRun() {
	rep, err := bench.Run(context.Background(), bench.Config{
		Stores:      []string{"memory"},
		Duration:    60 * time.Millisecond,
		Rounds:      1,
		Concurrency: []int{2},
		ReplayKeys:  8,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range rep.Results {
		ok := r.Check == "" && r.Throughput > 0
		fmt.Printf("%s %s clients=%d ok=%v\n", r.Target, r.Variant, r.Concurrency, ok)
	}
	// Output:
	// memory baseline clients=2 ok=true
	// memory first clients=2 ok=true
	// memory replay clients=2 ok=true
	// memory hot key clients=2 ok=true
}
