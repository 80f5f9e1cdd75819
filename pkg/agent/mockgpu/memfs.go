package mockgpu

import (
	"bytes"
	"io"
	"io/fs"
	"path"
	"slices"
	"strings"
	"time"
)

// FS is a read-only file tree in memory, as sysfs is read through io/fs:
// regular files, directories and symbolic links by slash-separated path
// without a leading slash. The directories above an entry exist without
// entries of their own. Symbolic links are followed in every component of
// a path but the last one that ReadLink and Lstat name; a link's target
// is relative to its directory. FS implements fs.ReadLinkFS,
// fs.ReadDirFS and fs.StatFS.
type FS map[string]*File

// File is one entry of an FS.
type File struct {
	// Data is a regular file's contents, or a symbolic link's target.
	Data []byte
	// Mode is fs.ModeDir for a directory, fs.ModeSymlink for a link, and
	// the permission bits (0o444 where they are 0).
	Mode fs.FileMode
}

var (
	_ fs.ReadLinkFS = FS{}
	_ fs.ReadDirFS  = FS{}
	_ fs.StatFS     = FS{}
)

// maxLinks bounds the symbolic links followed in one lookup, as the
// kernel's ELOOP limit does.
const maxLinks = 40

// resolve follows the symbolic links in name, the last component too
// unless lstat, and returns the path of what it names.
func (t FS) resolve(op, name string, lstat bool) (string, error) {
	if !fs.ValidPath(name) {
		return "", &fs.PathError{Op: op, Path: name, Err: fs.ErrInvalid}
	}
	rest := strings.Split(name, "/")
	if name == "." {
		rest = nil
	}
	cur, links := ".", 0
	for len(rest) > 0 {
		next := path.Join(cur, rest[0])
		rest = rest[1:]
		f, ok := t[next]
		if !ok || f.Mode&fs.ModeSymlink == 0 || (lstat && len(rest) == 0) {
			cur = next
			continue
		}
		if links++; links > maxLinks {
			return "", &fs.PathError{Op: op, Path: name, Err: fs.ErrInvalid}
		}
		target := path.Clean(path.Join(path.Dir(next), string(f.Data)))
		if strings.HasPrefix(target, "../") || target == ".." {
			return "", &fs.PathError{Op: op, Path: name, Err: fs.ErrNotExist}
		}
		rest = append(strings.Split(target, "/"), rest...)
		cur = "."
	}
	return cur, nil
}

// info returns what p (resolved) is, or nil where nothing is there.
func (t FS) info(p string) *fileInfo {
	if f, ok := t[p]; ok {
		mode := f.Mode
		if mode&fs.ModePerm == 0 {
			mode |= 0o444
		}
		return &fileInfo{name: path.Base(p), size: int64(len(f.Data)), mode: mode}
	}
	if p == "." || len(t.children(p)) > 0 {
		return &fileInfo{name: path.Base(p), mode: fs.ModeDir | 0o555}
	}
	return nil
}

// children returns the names directly below the directory p, sorted.
func (t FS) children(p string) []string {
	prefix := p + "/"
	if p == "." {
		prefix = ""
	}
	var names []string
	for name := range t {
		if rest, ok := strings.CutPrefix(name, prefix); ok && rest != "" {
			child, _, _ := strings.Cut(rest, "/")
			names = append(names, child)
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// Open implements fs.FS.
func (t FS) Open(name string) (fs.File, error) {
	p, err := t.resolve("open", name, false)
	if err != nil {
		return nil, err
	}
	fi := t.info(p)
	if fi == nil {
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	if fi.IsDir() {
		entries, _ := t.ReadDir(name)
		return &openDir{info: fi, entries: entries}, nil
	}
	return &openFile{info: fi, Reader: bytes.NewReader(t[p].Data)}, nil
}

// Stat implements fs.StatFS.
func (t FS) Stat(name string) (fs.FileInfo, error) { return t.stat("stat", name, false) }

// Lstat implements fs.ReadLinkFS.
func (t FS) Lstat(name string) (fs.FileInfo, error) { return t.stat("lstat", name, true) }

// stat is Stat, or Lstat where lstat: what name names, the last link
// followed or not.
func (t FS) stat(op, name string, lstat bool) (fs.FileInfo, error) {
	p, err := t.resolve(op, name, lstat)
	if err != nil {
		return nil, err
	}
	if fi := t.info(p); fi != nil {
		return fi, nil
	}
	return nil, &fs.PathError{Op: op, Path: name, Err: fs.ErrNotExist}
}

// ReadLink implements fs.ReadLinkFS.
func (t FS) ReadLink(name string) (string, error) {
	p, err := t.resolve("readlink", name, true)
	if err != nil {
		return "", err
	}
	f, ok := t[p]
	switch {
	case !ok && t.info(p) == nil:
		return "", &fs.PathError{Op: "readlink", Path: name, Err: fs.ErrNotExist}
	case !ok || f.Mode&fs.ModeSymlink == 0:
		return "", &fs.PathError{Op: "readlink", Path: name, Err: fs.ErrInvalid}
	}
	return string(f.Data), nil
}

// ReadDir implements fs.ReadDirFS.
func (t FS) ReadDir(name string) ([]fs.DirEntry, error) {
	p, err := t.resolve("readdir", name, false)
	if err != nil {
		return nil, err
	}
	fi := t.info(p)
	if fi == nil {
		return nil, &fs.PathError{Op: "readdir", Path: name, Err: fs.ErrNotExist}
	}
	if !fi.IsDir() {
		return nil, &fs.PathError{Op: "readdir", Path: name, Err: fs.ErrInvalid}
	}
	var entries []fs.DirEntry
	for _, child := range t.children(p) {
		entries = append(entries, fs.FileInfoToDirEntry(t.info(path.Join(p, child))))
	}
	return entries, nil
}

type fileInfo struct {
	name string
	size int64
	mode fs.FileMode
}

func (fi *fileInfo) Name() string       { return fi.name }
func (fi *fileInfo) Size() int64        { return fi.size }
func (fi *fileInfo) Mode() fs.FileMode  { return fi.mode }
func (fi *fileInfo) ModTime() time.Time { return time.Time{} }
func (fi *fileInfo) IsDir() bool        { return fi.mode.IsDir() }
func (fi *fileInfo) Sys() any           { return nil }

type openFile struct {
	info *fileInfo
	*bytes.Reader
}

func (f *openFile) Stat() (fs.FileInfo, error) { return f.info, nil }
func (f *openFile) Close() error               { return nil }

type openDir struct {
	info    *fileInfo
	entries []fs.DirEntry
	offset  int
}

func (d *openDir) Stat() (fs.FileInfo, error) { return d.info, nil }
func (d *openDir) Close() error               { return nil }
func (d *openDir) Read([]byte) (int, error) {
	return 0, &fs.PathError{Op: "read", Path: d.info.name, Err: fs.ErrInvalid}
}

// ReadDir implements fs.ReadDirFile.
func (d *openDir) ReadDir(n int) ([]fs.DirEntry, error) {
	rest := d.entries[d.offset:]
	if n <= 0 {
		d.offset = len(d.entries)
		return rest, nil
	}
	if len(rest) == 0 {
		return nil, io.EOF
	}
	rest = rest[:min(n, len(rest))]
	d.offset += len(rest)
	return rest, nil
}
