package integration

import (
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"k8s.io/kubernetes/test/utils/ktesting"
)

// A container of a claim, for the tests that run on a real GPU: runContainer
// starts a process that sees only what a container runtime would give it
// for an OCI spec with the claim's CDI devices applied, so that a test can
// show that what the CDI spec names is enough for NVML and CUDA, not only
// that it names the right files.
//
// The process runs in a new mount namespace, chrooted into an empty
// directory that holds:
//   - a base layer copied from this machine, standing for a container
//     image's: the C library (baseImageLibraries, as in a distribution's
//     smallest image), and the dynamic loader and the libraries that the
//     program links against where the spec does not mount them; so the
//     driver libraries a program loads get nothing beyond the C library
//     unless the spec gives it to them;
//   - the spec's mounts, bind-mounted read-only where the spec says so;
//   - its device nodes, created in a tmpfs on /dev with their major and
//     minor numbers, as runc creates them;
//   - proc on /proc and this machine's /sys;
//   - the links of the spec's nvidia-cdi-hook create-symlinks hooks; the
//     folders of its update-ldcache hooks go on LD_LIBRARY_PATH instead,
//     since the base has no ldconfig. Other hooks are reported and not run.
//
// Its environment is the spec's, with PATH and LD_LIBRARY_PATH. The
// program runs as nobody (containerUID), so that, as in a container whose
// device cgroup admits only the spec's devices, it can use no device node
// the spec does not name: the NVIDIA libraries create missing device nodes
// themselves where they may. Setting the container up needs root (mount
// namespaces, mknod, chroot); containerUnsupported says why a machine
// cannot run one.

// containerInitEnv names the file with a containerConfig. A test binary
// started with it set sets the container up and executes its program
// instead of running tests.
const containerInitEnv = "TOPODRA_TEST_CONTAINER_INIT"

func init() {
	if path := os.Getenv(containerInitEnv); path != "" {
		err := containerInit(path)
		// containerInit only returns on failure.
		fmt.Fprintf(os.Stderr, "container init: %v\n", err)
		os.Exit(127)
	}
}

// containerUID is the user and group the container's program runs as.
const containerUID = 65534

// containerConfig is what the init process of a container sets up.
type containerConfig struct {
	Root    string            `json:"root"`
	Mounts  []oci.Mount       `json:"mounts"`
	Devices []oci.LinuxDevice `json:"devices"`
	// Links are symbolic links to create: [target, link].
	Links [][2]string `json:"links"`
	Env   []string    `json:"env"`
	Args  []string    `json:"args"`
}

// containerUnsupported says why this machine cannot run runContainer, or
// returns "". Being root is not enough (a CI job in a container may not
// create mount namespaces or device nodes), so it starts a container that
// sets itself up and exits before running a program.
func containerUnsupported(tCtx ktesting.TContext) string {
	tCtx.Helper()
	if os.Geteuid() != 0 {
		return "not root: a container needs a mount namespace, mknod and chroot"
	}
	probe, refused := containerProbe(tCtx)
	switch {
	case probe == "":
		return ""
	case refused:
		return "the machine refuses what a container needs: " + probe
	}
	// Anything else is a fault of runContainer, which the tests that use
	// it must not hide behind a skip.
	tCtx.Fatalf("setting up an empty container failed: %s", probe)
	return ""
}

// containerProbe sets up an empty container and reports how that failed,
// or "", and whether the machine refused it (no permission for a mount
// namespace, a mount, mknod or chroot: a sandboxed or unprivileged
// runner).
func containerProbe(tCtx ktesting.TContext) (string, bool) {
	null := os.FileMode(0o666)
	spec := &oci.Spec{
		Process: &oci.Process{},
		Linux:   &oci.Linux{Devices: []oci.LinuxDevice{{Path: "/dev/null", Type: "c", Major: 1, Minor: 3, FileMode: &null}}},
	}
	out, err := runContainer(tCtx, spec, nil, containerProbeProgram)
	if err == nil {
		return "", false
	}
	lower := strings.ToLower(out)
	refused := errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.ENOSYS) ||
		strings.Contains(lower, "operation not permitted") || strings.Contains(lower, "permission denied") || strings.Contains(lower, "function not implemented")
	return fmt.Sprintf("%v: %s", err, strings.TrimSpace(out)), refused
}

// containerProbeProgram as a container's program makes its init process
// exit 0 once the container is set up, instead of executing a program.
const containerProbeProgram = "(probe)"

// runContainer runs args (args[0] a path inside the container) in a
// container of spec and returns what it wrote to stdout and stderr. files
// are host files to copy into the container before it starts, by their
// path inside it (a program the image would bring).
func runContainer(tCtx ktesting.TContext, spec *oci.Spec, files map[string]string, args ...string) (string, error) {
	tCtx.Helper()
	dir := tCtx.TempDir()
	root := filepath.Join(dir, "rootfs")
	tCtx.ExpectNoError(os.MkdirAll(root, 0o755))

	cfg := containerConfig{Root: root, Mounts: spec.Mounts, Args: args}
	if spec.Linux != nil {
		cfg.Devices = spec.Linux.Devices
	}
	var libPath []string
	if spec.Hooks != nil {
		for _, hook := range slices.Concat(spec.Hooks.Prestart, spec.Hooks.CreateRuntime, spec.Hooks.CreateContainer, spec.Hooks.StartContainer) {
			links, folders, known := cdiHookEffects(hook.Args)
			if !known {
				tCtx.Logf("container: not running hook %v", hook.Args)
				continue
			}
			cfg.Links = append(cfg.Links, links...)
			libPath = append(libPath, folders...)
		}
	}

	for dst, src := range files {
		copyFile(tCtx, src, filepath.Join(root, dst), 0o755)
	}
	// The base layer: the C library, and what the program needs that the
	// spec does not mount.
	var program []string
	if src, ok := files[args[0]]; ok {
		program = append(program, src)
	}
	provided := map[string]bool{}
	for _, m := range spec.Mounts {
		provided[filepath.Base(m.Destination)] = true
		if m.Destination == args[0] {
			program = append(program, m.Source)
		}
	}
	for _, l := range cfg.Links {
		provided[filepath.Base(l[1])] = true
	}
	base := baseLibraries(tCtx, program, provided)
	for _, lib := range baseImageLibraries {
		if host := findLibrary(lib); host != "" && !slices.Contains(base, host) {
			base = append(base, host)
		}
	}
	for _, lib := range base {
		copyFile(tCtx, lib, filepath.Join(root, lib), 0o755)
		libPath = append(libPath, filepath.Dir(lib))
	}

	env := slices.Clone(spec.Process.Env)
	env = append(env, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	slices.Sort(libPath)
	env = append(env, "LD_LIBRARY_PATH="+strings.Join(slices.Compact(libPath), ":"))
	cfg.Env = env
	var nodes []string
	for _, d := range cfg.Devices {
		nodes = append(nodes, d.Path)
	}
	tCtx.Logf("container of %d mounts, device nodes %v, links %v, base layer %v, %s", len(cfg.Mounts), nodes, cfg.Links, base, env[len(env)-1])

	data, err := json.Marshal(cfg)
	tCtx.ExpectNoError(err)
	cfgPath := filepath.Join(dir, "config.json")
	tCtx.ExpectNoError(os.WriteFile(cfgPath, data, 0o600))

	self, err := os.Executable()
	tCtx.ExpectNoError(err)
	cmd := exec.CommandContext(tCtx, self)
	cmd.Env = []string{containerInitEnv + "=" + cfgPath}
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// cdiHookEffects returns what an nvidia-cdi-hook invocation does to a
// container: the links of create-symlinks ("--link target::link") and the
// folders of update-ldcache ("--folder dir"); known is false for other
// hooks.
func cdiHookEffects(args []string) (links [][2]string, folders []string, known bool) {
	i := slices.IndexFunc(args, func(a string) bool { return a == "create-symlinks" || a == "update-ldcache" })
	if i < 0 {
		return nil, nil, false
	}
	for j := i + 1; j < len(args); j++ {
		flag, value, hasValue := strings.Cut(args[j], "=")
		if !hasValue && j+1 < len(args) {
			value = args[j+1]
		}
		switch flag {
		case "--link":
			if target, link, ok := strings.Cut(value, "::"); ok {
				links = append(links, [2]string{target, link})
			}
		case "--folder":
			folders = append(folders, value)
		default:
			continue
		}
		if !hasValue {
			j++
		}
	}
	return links, folders, true
}

// libraryDirs are where baseLibraries looks for a library on this machine.
var libraryDirs = []string{"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"}

// baseImageLibraries are the shared libraries of the C library and of the
// compiler's runtime, which the smallest images of glibc distributions
// (and so the CUDA base images) hold.
var baseImageLibraries = []string{"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libutil.so.1", "libgcc_s.so.1"}

// findLibrary returns the path of lib in libraryDirs, or "".
func findLibrary(lib string) string {
	for _, dir := range libraryDirs {
		if _, err := os.Stat(filepath.Join(dir, lib)); err == nil {
			return filepath.Join(dir, lib)
		}
	}
	return ""
}

// baseLibraries returns the host paths of the dynamic loader of the
// binaries and of every library they need, transitively, that provided
// does not name.
func baseLibraries(tCtx ktesting.TContext, binaries []string, provided map[string]bool) []string {
	tCtx.Helper()
	var out []string
	seen := map[string]bool{}
	queue := slices.Clone(binaries)
	for len(queue) > 0 {
		path := queue[0]
		queue = queue[1:]
		f, err := elf.Open(path)
		if err != nil {
			tCtx.Fatalf("read %s: %v", path, err)
		}
		needed, err := f.ImportedLibraries()
		if err != nil {
			tCtx.Fatalf("libraries of %s: %v", path, err)
		}
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				interp, err := io.ReadAll(p.Open())
				if err != nil {
					tCtx.Fatalf("loader of %s: %v", path, err)
				}
				if loader := strings.TrimRight(string(interp), "\x00"); !seen[loader] {
					seen[loader] = true
					out = append(out, loader)
				}
			}
		}
		_ = f.Close()
		for _, lib := range needed {
			if provided[lib] || seen[lib] {
				continue
			}
			seen[lib] = true
			found := findLibrary(lib)
			if found == "" {
				tCtx.Fatalf("%s needs %s, which is neither in the container nor in %v", path, lib, libraryDirs)
			}
			out = append(out, found)
			queue = append(queue, found)
		}
	}
	return out
}

// copyFile copies src, following links, to dst.
func copyFile(tCtx ktesting.TContext, src, dst string, mode os.FileMode) {
	tCtx.Helper()
	data, err := os.ReadFile(src)
	tCtx.ExpectNoError(err)
	tCtx.ExpectNoError(os.MkdirAll(filepath.Dir(dst), 0o755))
	tCtx.ExpectNoError(os.WriteFile(dst, data, mode))
}

// containerInit sets up the container described by the file at path in
// this process's mount namespace, which must be its own, and executes its
// program. It returns only on failure.
func containerInit(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var c containerConfig
	if err := json.Unmarshal(data, &c); err != nil {
		return err
	}
	if len(c.Args) == 0 {
		return errors.New("no program")
	}
	// Nothing mounted here may reach the machine's mount namespace.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	// The root on a mount of its own that allows programs and device
	// nodes, wherever the temporary directory is (/tmp may be noexec).
	if err := unix.Mount(c.Root, c.Root, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind the root: %w", err)
	}
	if err := unix.Mount("", c.Root, "", unix.MS_BIND|unix.MS_REMOUNT, ""); err != nil {
		return fmt.Errorf("remount the root: %w", err)
	}
	for _, m := range c.Mounts {
		if err := bindMount(c.Root, m); err != nil {
			return err
		}
	}
	dev := filepath.Join(c.Root, "dev")
	if err := os.MkdirAll(dev, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("tmpfs", dev, "tmpfs", unix.MS_NOSUID, "mode=755"); err != nil {
		return fmt.Errorf("mount /dev: %w", err)
	}
	for _, d := range c.Devices {
		if err := makeDevice(c.Root, d); err != nil {
			return err
		}
	}
	for _, l := range c.Links {
		link := filepath.Join(c.Root, l[1])
		if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
			return err
		}
		if err := os.Symlink(l[0], link); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("link %s -> %s: %w", l[1], l[0], err)
		}
	}
	proc, sys, tmp := filepath.Join(c.Root, "proc"), filepath.Join(c.Root, "sys"), filepath.Join(c.Root, "tmp")
	for _, d := range []string{proc, sys, tmp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := os.Chmod(tmp, 0o1777); err != nil {
		return err
	}
	if err := unix.Mount("proc", proc, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	if err := unix.Mount("/sys", sys, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("mount /sys: %w", err)
	}
	if err := unix.Chroot(c.Root); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	if err := syscall.Setgroups(nil); err != nil {
		return fmt.Errorf("drop groups: %w", err)
	}
	if err := syscall.Setgid(containerUID); err != nil {
		return fmt.Errorf("setgid: %w", err)
	}
	if err := syscall.Setuid(containerUID); err != nil {
		return fmt.Errorf("setuid: %w", err)
	}
	if c.Args[0] == containerProbeProgram {
		os.Exit(0)
	}
	return unix.Exec(c.Args[0], c.Args, c.Env)
}

// bindMount mounts m below root: a file on a file, a directory on a
// directory; read-only where m's options say "ro".
func bindMount(root string, m oci.Mount) error {
	if m.Type != "" && m.Type != "bind" && !slices.Contains(m.Options, "bind") && !slices.Contains(m.Options, "rbind") {
		return fmt.Errorf("mount %s of type %s: only bind mounts are supported", m.Destination, m.Type)
	}
	st, err := os.Stat(m.Source)
	if err != nil {
		return fmt.Errorf("mount %s: %w", m.Destination, err)
	}
	dst := filepath.Join(root, m.Destination)
	if st.IsDir() {
		err = os.MkdirAll(dst, 0o755)
	} else if err = os.MkdirAll(filepath.Dir(dst), 0o755); err == nil {
		var f *os.File
		if f, err = os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
			err = f.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("mount point %s: %w", m.Destination, err)
	}
	flags := uintptr(unix.MS_BIND)
	if slices.Contains(m.Options, "rbind") {
		flags |= unix.MS_REC
	}
	if err := unix.Mount(m.Source, dst, "", flags, ""); err != nil {
		return fmt.Errorf("bind %s on %s: %w", m.Source, m.Destination, err)
	}
	if slices.Contains(m.Options, "ro") {
		flags = unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY
		for opt, flag := range map[string]uintptr{"nosuid": unix.MS_NOSUID, "nodev": unix.MS_NODEV, "noexec": unix.MS_NOEXEC} {
			if slices.Contains(m.Options, opt) {
				flags |= flag
			}
		}
		if err := unix.Mount("", dst, "", flags, ""); err != nil {
			return fmt.Errorf("make %s read-only: %w", m.Destination, err)
		}
	}
	return nil
}

// makeDevice creates the device node d below root.
func makeDevice(root string, d oci.LinuxDevice) error {
	var kind uint32
	switch d.Type {
	case "c", "u":
		kind = unix.S_IFCHR
	case "b":
		kind = unix.S_IFBLK
	default:
		return fmt.Errorf("device %s of type %q", d.Path, d.Type)
	}
	mode := uint32(0o666)
	if d.FileMode != nil {
		mode = uint32(d.FileMode.Perm())
	}
	dst := filepath.Join(root, d.Path)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if err := unix.Mknod(dst, kind|mode, int(unix.Mkdev(uint32(d.Major), uint32(d.Minor)))); err != nil {
		return fmt.Errorf("mknod %s (%d:%d): %w", d.Path, d.Major, d.Minor, err)
	}
	// The mode as given, not as the umask leaves it.
	return os.Chmod(dst, os.FileMode(mode))
}

// TestContainerGetsOnlyItsSpec checks runContainer itself, with programs of
// this machine in place of a driver's: the container's root holds only the
// spec's mounts, device nodes and hook links, the base libraries, /proc,
// /sys and /tmp; the spec's mounts are read-only where it says so; its
// environment is the spec's; its program runs as nobody and can create no
// file outside /tmp (no device node); nothing of it stays mounted on the
// machine.
func TestContainerGetsOnlyItsSpec(t *testing.T) {
	tCtx := ktesting.Init(t)
	if why := containerUnsupported(tCtx); why != "" {
		tCtx.Skipf("no container here: %s", why)
	}
	var mounts []oci.Mount
	for _, prog := range []string{"ls", "cat", "env", "touch", "id"} {
		host, err := exec.LookPath(prog)
		if err != nil {
			tCtx.Skipf("no %s here: %v", prog, err)
		}
		mounts = append(mounts, oci.Mount{Source: host, Destination: "/usr/bin/" + prog, Options: []string{"ro", "nosuid", "nodev", "bind"}})
	}
	data := tCtx.TempDir()
	tCtx.ExpectNoError(os.WriteFile(filepath.Join(data, "hello"), []byte("hello from the spec\n"), 0o644))
	mounts = append(mounts, oci.Mount{Source: data, Destination: "/data", Options: []string{"ro", "nosuid", "nodev", "bind"}})
	null := os.FileMode(0o666)
	spec := &oci.Spec{
		Process: &oci.Process{Env: []string{"GREETING=hi"}},
		Mounts:  mounts,
		Linux:   &oci.Linux{Devices: []oci.LinuxDevice{{Path: "/dev/null", Type: "c", Major: 1, Minor: 3, FileMode: &null}}},
		Hooks: &oci.Hooks{CreateContainer: []oci.Hook{
			{Path: "/usr/bin/nvidia-cdi-hook", Args: []string{"nvidia-cdi-hook", "create-symlinks", "--link", "/data/hello::/etc/greeting"}},
			{Path: "/usr/bin/nvidia-cdi-hook", Args: []string{"nvidia-cdi-hook", "update-ldcache", "--folder", "/data"}},
		}},
	}

	run := func(args ...string) string {
		tCtx.Helper()
		out, err := runContainer(tCtx, spec, nil, args...)
		if err != nil {
			tCtx.Fatalf("%v in the container: %v\n%s", args, err, out)
		}
		return out
	}
	allowed := []string{"data", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sys", "tmp", "usr"}
	for _, entry := range strings.Fields(run("/usr/bin/ls", "-1", "/")) {
		if !slices.Contains(allowed, entry) {
			tCtx.Errorf("the container's / holds %s, which neither the spec nor the base layer put there", entry)
		}
	}
	if got := strings.Fields(run("/usr/bin/ls", "-1", "/dev")); !slices.Equal(got, []string{"null"}) {
		tCtx.Errorf("the container's /dev holds %v, want [null]", got)
	}
	if got := run("/usr/bin/cat", "/etc/greeting"); got != "hello from the spec\n" {
		tCtx.Errorf("/etc/greeting (a hook's link) reads %q", got)
	}
	env := strings.Split(strings.TrimSpace(run("/usr/bin/env")), "\n")
	if !slices.Contains(env, "GREETING=hi") || !slices.ContainsFunc(env, func(e string) bool {
		return strings.HasPrefix(e, "LD_LIBRARY_PATH=") && strings.Contains(e, "/data")
	}) {
		tCtx.Errorf("the container's environment is %v, want GREETING=hi and /data in LD_LIBRARY_PATH", env)
	}
	if got, want := strings.TrimSpace(run("/usr/bin/id", "-u")), fmt.Sprint(containerUID); got != want {
		tCtx.Errorf("the container's program runs as user %s, want %s", got, want)
	}
	for _, file := range []string{"/data/written", "/dev/nvidia0"} {
		if out, err := runContainer(tCtx, spec, nil, "/usr/bin/touch", file); err == nil {
			tCtx.Errorf("the container's program created %s: %s", file, out)
		}
	}
	run("/usr/bin/touch", "/tmp/written", "/dev/null")
	mountinfo, err := os.ReadFile("/proc/self/mountinfo")
	tCtx.ExpectNoError(err)
	if strings.Contains(string(mountinfo), "rootfs/usr/bin") {
		tCtx.Errorf("a container's mount is left on the machine:\n%s", mountinfo)
	}
}
