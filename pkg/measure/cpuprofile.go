package measure

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"runtime/pprof"
	"syscall"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// Where every component runs in one process, the process' CPU time says
// little about one of them. A component started under a pprof label (say
// scheduler=<name>) passes the label to its goroutines and to the
// goroutines they start, and a CPU profile of the measured interval,
// summed over the samples with the label, is that component's own CPU
// time. Profiling samples at 100 Hz, so short runs have a resolution of
// 10 ms.

// CPUProfile is a CPU profile being recorded into memory.
type CPUProfile struct {
	buf     bytes.Buffer
	started bool
	rusage0 time.Duration
}

// StartCPUProfile starts profiling. When a profile is already running (go
// test -cpuprofile, or the command's own), it records nothing and Stop
// reports -1 for the labelled time.
func StartCPUProfile() *CPUProfile {
	p := &CPUProfile{rusage0: processCPU()}
	p.started = pprof.StartCPUProfile(&p.buf) == nil
	return p
}

// Stop ends the profile and returns the seconds of CPU spent by goroutines
// labelled key=value (or -1), the process' CPU seconds, and the raw
// profile (nil when none was recorded).
func (p *CPUProfile) Stop(key, value string) (labelled, process float64, raw []byte, err error) {
	process = (processCPU() - p.rusage0).Seconds()
	if !p.started {
		return -1, process, nil, nil
	}
	pprof.StopCPUProfile()
	raw = p.buf.Bytes()
	ns, err := labelledCPU(raw, key, value)
	if err != nil {
		return -1, process, raw, err
	}
	return float64(ns) / 1e9, process, raw, nil
}

// processCPU is the user+system CPU time of the process so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// labelledCPU sums the cpu/nanoseconds values of the samples of a pprof
// profile (gzipped profile.proto) that carry label key=value. It reads
// only what it needs: sample_type (1), sample (2: value 2, label 3) and
// string_table (6).
func labelledCPU(raw []byte, key, value string) (int64, error) {
	zr, err := gzip.NewReader(bytes.NewReader(raw))
	if err != nil {
		return 0, fmt.Errorf("read profile: %w", err)
	}
	data, err := io.ReadAll(zr)
	if err != nil {
		return 0, fmt.Errorf("read profile: %w", err)
	}
	type label struct{ key, str int64 }
	type sample struct {
		values []int64
		labels []label
	}
	var (
		sampleTypes [][2]int64 // type, unit string indexes
		samples     []sample
		strs        []string
	)
	err = fields(data, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		switch num {
		case 1:
			var t [2]int64
			err := fields(v, func(num protowire.Number, _ protowire.Type, _ []byte, x uint64) error {
				if num == 1 || num == 2 {
					t[num-1] = int64(x)
				}
				return nil
			})
			sampleTypes = append(sampleTypes, t)
			return err
		case 2:
			var s sample
			err := fields(v, func(num protowire.Number, typ protowire.Type, b []byte, x uint64) error {
				switch {
				case num == 2 && typ == protowire.BytesType: // packed values
					for len(b) > 0 {
						x, n := protowire.ConsumeVarint(b)
						if n < 0 {
							return protowire.ParseError(n)
						}
						s.values = append(s.values, int64(x))
						b = b[n:]
					}
				case num == 2:
					s.values = append(s.values, int64(x))
				case num == 3:
					var l label
					err := fields(b, func(num protowire.Number, _ protowire.Type, _ []byte, x uint64) error {
						switch num {
						case 1:
							l.key = int64(x)
						case 2:
							l.str = int64(x)
						}
						return nil
					})
					if err != nil {
						return err
					}
					s.labels = append(s.labels, l)
				}
				return nil
			})
			samples = append(samples, s)
			return err
		case 6:
			strs = append(strs, string(v))
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("parse profile: %w", err)
	}
	str := func(i int64) string {
		if i < 0 || int(i) >= len(strs) {
			return ""
		}
		return strs[i]
	}
	cpu := -1
	for i, t := range sampleTypes {
		if str(t[0]) == "cpu" {
			cpu = i
		}
	}
	if cpu < 0 {
		return 0, fmt.Errorf("profile has no cpu sample type")
	}
	var total int64
	for _, s := range samples {
		for _, l := range s.labels {
			if str(l.key) == key && str(l.str) == value && cpu < len(s.values) {
				total += s.values[cpu]
			}
		}
	}
	return total, nil
}

// fields calls f for each field of a protobuf message: v is the payload of
// length-delimited fields, x the value of varint and fixed fields.
func fields(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var v []byte
		var x uint64
		switch typ {
		case protowire.VarintType:
			x, n = protowire.ConsumeVarint(b)
		case protowire.Fixed64Type:
			x, n = protowire.ConsumeFixed64(b)
		case protowire.Fixed32Type:
			var x32 uint32
			x32, n = protowire.ConsumeFixed32(b)
			x = uint64(x32)
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if err := f(num, typ, v, x); err != nil {
			return err
		}
	}
	return nil
}
