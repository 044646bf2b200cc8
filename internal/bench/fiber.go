package bench

import (
	"encoding/json"
	"net"
	"strconv"
	"time"

	"github.com/gofiber/fiber/v2"
	"github.com/gofiber/fiber/v2/middleware/idempotency"
)

// FiberVersion is the version of github.com/gofiber/fiber/v2 compared against.
const FiberVersion = "v2.52.15"

// fiberOrders is ordersHandler for Fiber: the same decoding, insert and answer.
func fiberOrders(b backend) fiber.Handler {
	return func(c *fiber.Ctx) error {
		var in struct {
			Item string `json:"item"`
			Qty  int    `json:"qty"`
		}
		if err := json.Unmarshal(c.Body(), &in); err != nil || in.Item == "" || in.Qty < 1 {
			return c.Status(fiber.StatusBadRequest).SendString(`want {"item": "…", "qty": n}`)
		}
		id, err := b.insert(c.UserContext(), in.Item, in.Qty)
		if err != nil {
			return c.Status(fiber.StatusInternalServerError).SendString("insert order: " + err.Error())
		}
		body, _ := json.Marshal(order{ID: id, Item: in.Item, Qty: in.Qty})
		c.Set(fiber.HeaderContentType, fiber.MIMEApplicationJSON)
		c.Set(fiber.HeaderLocation, "/orders/"+strconv.FormatInt(id, 10))
		return c.Status(fiber.StatusCreated).Send(body)
	}
}

// setupFiber starts a Fiber app on loopback with the bare handler on
// /bare/orders and Fiber's idempotency middleware, with its default in-memory
// storage and lock, on /idem/orders. The orders go to an in-process map, as for
// the memory target.
func setupFiber() (*target, error) {
	t := &target{
		name: "fiber", backend: newMemBackend(), version: "Fiber " + FiberVersion + " (fasthttp)",
		store: "fiber idempotency, default in-memory storage",
	}
	app := fiber.New(fiber.Config{DisableStartupMessage: true})
	h := fiberOrders(t.backend)
	app.Post("/bare/orders", h)
	app.Get(statsPath, func(c *fiber.Ctx) error {
		s, err := t.snapshot(c.UserContext(), c.Query("gc") == "1")
		if err != nil {
			return c.Status(fiber.StatusInternalServerError).SendString(err.Error())
		}
		return c.JSON(s)
	})
	app.Post("/idem/orders", idempotency.New(idempotency.Config{
		KeyHeader: "Idempotency-Key", // the default is X-Idempotency-Key; keys are UUIDs (its default check)
		Lifetime:  time.Hour,
	}), h)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	go func() { _ = app.Listener(ln) }()
	t.url = "http://" + ln.Addr().String()
	t.variants = []variant{
		{VariantBaseline, "/bare/orders", keysNone},
		{VariantFirst, "/idem/orders", keysFresh},
		{VariantReplay, "/idem/orders", keysPool},
		{VariantHot, "/idem/orders", keysHot},
	}
	t.close = func() { _ = app.ShutdownWithTimeout(10 * time.Second) }
	return t, nil
}
